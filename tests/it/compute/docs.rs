//! The documentation as a user reads it, checked against the binary and the repository:
//! docs/stages.md is what `duplex stages --markdown` prints; every `duplex …` command in a fenced
//! shell block of README.md and docs/ names a real subcommand and only flags its `--help` lists;
//! every `make` target named exists; every YAML block that is a pipeline file or a server or
//! daemon config uses only stage kinds, params and keys that exist; every relative link resolves;
//! the README stays short and reaches every document.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use duplex::config::{KindCatalog, PIPELINE_KEYS};
use duplex::stages::Registry;
use yaml_rust2::{Yaml, YamlLoader};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every Markdown file under docs/, with their text.
fn documents() -> Vec<(PathBuf, String)> {
    let mut files = vec![root().join("README.md")];
    let mut dirs = vec![root().join("docs")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let t = std::fs::read_to_string(&p).unwrap();
            (p, t)
        })
        .collect()
}

fn name(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

/// A fenced block: its info string's first word, its first line's number, its text.
struct Block {
    lang: String,
    line: usize,
    text: String,
}

fn blocks(text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<(String, String, Block)> = None;
    for (i, l) in text.lines().enumerate() {
        let t = l.trim_start();
        match &mut open {
            None => {
                for fence in ["```", "~~~"] {
                    if let Some(info) = t.strip_prefix(fence) {
                        let marker: String = fence
                            .chars()
                            .chain(
                                info.chars()
                                    .take_while(|c| *c == fence.as_bytes()[0] as char),
                            )
                            .collect();
                        let lang = info.trim_start_matches(fence.as_bytes()[0] as char);
                        let lang = lang.split_whitespace().next().unwrap_or("").to_lowercase();
                        open = Some((
                            marker,
                            lang.clone(),
                            Block {
                                lang,
                                line: i + 2,
                                text: String::new(),
                            },
                        ));
                        break;
                    }
                }
            }
            Some((marker, _, b)) => {
                if t.starts_with(marker.as_str())
                    && t.trim_end()
                        .chars()
                        .all(|c| c == marker.chars().next().unwrap())
                {
                    out.push(open.take().unwrap().2);
                } else {
                    b.text.push_str(l);
                    b.text.push('\n');
                }
            }
        }
    }
    assert!(open.is_none(), "a fenced block is not closed");
    out
}

/// Shell words of a line (quotes and escapes as the shell reads them; `#` starts a comment),
/// with `&&`, `||`, `;`, `|`, `&` as words of their own.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut w = String::new();
    let mut started = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                started = true;
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    w.push(c);
                }
            }
            '"' => {
                started = true;
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => w.extend(chars.next()),
                        c => w.push(c),
                    }
                }
            }
            '\\' => {
                started = true;
                w.extend(chars.next());
            }
            '#' if !started => break,
            ';' | '|' | '&' => {
                if started {
                    out.push(std::mem::take(&mut w));
                    started = false;
                }
                let mut op = c.to_string();
                if chars.peek() == Some(&c) {
                    op.push(chars.next().unwrap());
                }
                out.push(op);
            }
            c if c.is_whitespace() => {
                if started {
                    out.push(std::mem::take(&mut w));
                    started = false;
                }
            }
            c => {
                started = true;
                w.push(c);
            }
        }
    }
    if started {
        out.push(w);
    }
    out
}

/// The `duplex` invocations of a shell block: the arguments after the binary.
fn duplex_commands(block: &str) -> Vec<Vec<String>> {
    let joined = block.replace("\\\n", " ");
    let mut out = Vec::new();
    for line in joined.lines() {
        let line = line.trim_start().trim_start_matches("$ ");
        let ws = words(line);
        for cmd in ws.split(|w| ["&&", "||", ";", "|", "&"].contains(&w.as_str())) {
            let mut rest = cmd;
            // Environment assignments and wrappers before the program.
            while let Some((w, tail)) = rest.split_first() {
                let assignment = w.split_once('=').is_some_and(|(k, _)| {
                    !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                });
                if assignment || ["sudo", "time", "exec", "env", "nohup"].contains(&w.as_str()) {
                    rest = tail;
                } else {
                    break;
                }
            }
            let Some((program, args)) = rest.split_first() else {
                continue;
            };
            if program == "duplex" || program.ends_with("/duplex") {
                out.push(args.to_vec());
            } else if program == "cargo" && args.first().is_some_and(|a| a == "run") {
                if let Some(i) = args.iter().position(|a| a == "--") {
                    out.push(args[i + 1..].to_vec());
                }
            }
        }
    }
    out
}

fn help(args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(o.status.success(), "duplex {args:?} --help failed");
    String::from_utf8(o.stdout).unwrap()
}

/// The words of a help text that are flags (`--name`, `-n`).
fn flags_of(help: &str) -> BTreeSet<String> {
    help.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']' || c == '=')
        .filter(|w| w.starts_with('-') && w.len() > 1)
        .map(|w| w.split('<').next().unwrap().to_string())
        .collect()
}

#[test]
fn the_stage_reference_is_what_duplex_stages_prints() {
    let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["stages", "--markdown"])
        .output()
        .unwrap();
    assert!(o.status.success());
    let printed = String::from_utf8(o.stdout).unwrap();
    let file = std::fs::read_to_string(root().join("docs/stages.md")).unwrap_or_default();
    assert!(
        file == printed,
        "docs/stages.md is stale: run `target/release/duplex stages --markdown > docs/stages.md`"
    );
    // Every kind is in it, with every param.
    for k in Registry::builtin().kinds() {
        assert!(
            printed.contains(&format!("\n## {}\n", k.name)),
            "{}",
            k.name
        );
        for p in k.params {
            assert!(
                printed.contains(&format!("| `{}` |", p.name)),
                "{}.{}",
                k.name,
                p.name
            );
        }
    }
}

#[test]
fn every_duplex_command_in_the_docs_names_a_subcommand_and_flags_that_exist() {
    let top = help(&[]);
    let subcommands: BTreeSet<String> = top
        .split("Commands:")
        .nth(1)
        .unwrap()
        .split("Options:")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    assert!(subcommands.contains("serve") && subcommands.contains("run"));
    let global = flags_of(top.split("Options:").nth(1).unwrap());
    let mut helps: HashMap<String, BTreeSet<String>> = HashMap::new();
    let mut faults = Vec::new();
    let mut checked = 0;
    for (path, text) in documents() {
        for b in blocks(&text) {
            if !["sh", "bash", "shell", "console", "zsh"].contains(&b.lang.as_str()) {
                continue;
            }
            for args in duplex_commands(&b.text) {
                let at = format!("{} (block at line {})", name(&path), b.line);
                let mut it = args.iter().peekable();
                let mut sub = None;
                while let Some(a) = it.next() {
                    if a == "--log" {
                        it.next();
                    } else if !a.starts_with('-') {
                        sub = Some(a.clone());
                        break;
                    } else if !global.contains(a.split('=').next().unwrap()) {
                        faults.push(format!(
                            "{at}: `duplex {}`: {a} is no global flag",
                            args.join(" ")
                        ));
                    }
                }
                let Some(sub) = sub else {
                    continue;
                };
                if !subcommands.contains(&sub) {
                    faults.push(format!("{at}: `duplex {sub}` is no subcommand"));
                    continue;
                }
                // A subcommand of its own (`duplex eval run`): its flags are that one's.
                let own = help(&[&sub]);
                let mut words = vec![sub.clone()];
                if let Some(list) = own.split("Commands:").nth(1) {
                    let subs: BTreeSet<&str> = list
                        .split("Options:")
                        .next()
                        .unwrap()
                        .lines()
                        .filter_map(|l| l.split_whitespace().next())
                        .collect();
                    match it.next() {
                        Some(w) if subs.contains(w.as_str()) => words.push(w.clone()),
                        w => {
                            faults.push(format!(
                                "{at}: `duplex {sub}` needs one of {subs:?}, not {w:?}"
                            ));
                            continue;
                        }
                    }
                }
                let key = words.join(" ");
                let known = helps.entry(key.clone()).or_insert_with(|| {
                    flags_of(&help(&words.iter().map(String::as_str).collect::<Vec<_>>()))
                });
                for a in it.filter(|a| a.starts_with('-') && a.len() > 1 && *a != "--") {
                    let flag = a.split('=').next().unwrap();
                    if !known.contains(flag) && !global.contains(flag) {
                        faults.push(format!("{at}: `duplex {key}` has no flag {flag}"));
                    }
                }
                checked += 1;
            }
        }
    }
    assert!(faults.is_empty(), "{}", faults.join("\n"));
    assert!(checked >= 20, "only {checked} duplex commands in the docs");
}

#[test]
fn every_make_target_in_the_docs_exists() {
    let makefile = std::fs::read_to_string(root().join("Makefile")).unwrap();
    let targets: BTreeSet<&str> = makefile
        .lines()
        .filter_map(|l| l.split_once(':').map(|(t, _)| t))
        .filter(|t| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
        .collect();
    let mut faults = Vec::new();
    let mut checked = 0;
    for (path, text) in documents() {
        for b in blocks(&text) {
            if !["sh", "bash", "shell", "console"].contains(&b.lang.as_str()) {
                continue;
            }
            for line in b.text.lines() {
                let ws = words(line.trim_start_matches("$ "));
                for cmd in ws.split(|w| ["&&", "||", ";", "|"].contains(&w.as_str())) {
                    if cmd.first().is_some_and(|w| w == "make") {
                        for t in cmd[1..]
                            .iter()
                            .filter(|w| !w.starts_with('-') && !w.contains('='))
                        {
                            checked += 1;
                            if !targets.contains(t.as_str()) {
                                faults.push(format!("{}: make {t}: no such target", name(&path)));
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(faults.is_empty(), "{}", faults.join("\n"));
    assert!(checked >= 2, "the docs name {checked} make targets");
}

/// Every key path of a YAML mapping (`a`, `a.b`, …), not descending into `stages`.
fn key_paths(y: &Yaml, prefix: &str, out: &mut BTreeSet<String>) {
    if let Yaml::Hash(h) = y {
        for (k, v) in h {
            let Some(k) = k.as_str() else { continue };
            let p = if prefix.is_empty() {
                k.to_string()
            } else {
                format!("{prefix}.{k}")
            };
            out.insert(p.clone());
            if p != "stages" {
                key_paths(v, &p, out);
            }
        }
    }
}

fn load_yaml(text: &str) -> Yaml {
    YamlLoader::load_from_str(text)
        .unwrap()
        .into_iter()
        .next()
        .unwrap_or(Yaml::Null)
}

#[test]
fn every_yaml_key_in_the_docs_exists() {
    // What a server, daemon or pipeline config may say: the keys of the defaults files.
    let mut config_keys = BTreeSet::new();
    for f in [
        "configs/serve.yaml",
        "configs/daemon.yaml",
        "configs/default.yaml",
    ] {
        let y = load_yaml(&std::fs::read_to_string(root().join(f)).unwrap());
        key_paths(&y, "", &mut config_keys);
    }
    let registry = Registry::builtin();
    // YAML of other programs (Kubernetes, compose, Prometheus, Grafana) is theirs to check.
    let foreign = [
        "apiVersion",
        "services",
        "scrape_configs",
        "groups",
        "rule_files",
        "datasources",
        "providers",
        "global",
        "rules",
    ];
    let mut faults = Vec::new();
    let mut checked = 0;
    for (path, text) in documents() {
        for b in blocks(&text) {
            if !["yaml", "yml"].contains(&b.lang.as_str()) {
                continue;
            }
            let at = format!("{} (block at line {})", name(&path), b.line);
            let y = match YamlLoader::load_from_str(&b.text) {
                Ok(mut docs) if !docs.is_empty() => docs.remove(0),
                Ok(_) => continue,
                Err(e) => {
                    faults.push(format!("{at}: not YAML: {e}"));
                    continue;
                }
            };
            let Yaml::Hash(h) = &y else { continue };
            if h.keys()
                .any(|k| k.as_str().is_some_and(|k| foreign.contains(&k)))
            {
                continue;
            }
            let mut paths = BTreeSet::new();
            key_paths(&y, "", &mut paths);
            if let Some(stages) = y["stages"].as_hash() {
                // A pipeline file: its sections, its stages' kinds and params.
                for (k, _) in h {
                    let k = k.as_str().unwrap_or("");
                    if !PIPELINE_KEYS.contains(&k) {
                        faults.push(format!(
                            "{at}: `{k}` is no top-level key of a pipeline file"
                        ));
                    }
                }
                for (stage, spec) in stages {
                    let stage = stage.as_str().unwrap_or("?");
                    let Some(kind) = spec["kind"].as_str() else {
                        faults.push(format!("{at}: stage `{stage}` has no kind"));
                        continue;
                    };
                    let Some(params) = registry.params(kind) else {
                        faults.push(format!("{at}: stage `{stage}`: no stage kind `{kind}`"));
                        continue;
                    };
                    for (k, v) in spec.as_hash().unwrap() {
                        let k = k.as_str().unwrap_or("");
                        checked += 1;
                        if k == "inject_delay" {
                            let inject = registry.params("inject_delay").unwrap();
                            for (ik, _) in v.as_hash().into_iter().flatten() {
                                let ik = ik.as_str().unwrap_or("");
                                if !inject.iter().any(|p| p.name == ik) {
                                    faults.push(format!(
                                        "{at}: stage `{stage}`: inject_delay has no param `{ik}`"
                                    ));
                                }
                            }
                        } else if k != "kind" && !params.iter().any(|p| p.name == k) {
                            faults.push(format!(
                                "{at}: stage `{stage}`: a `{kind}` stage has no param `{k}`"
                            ));
                        }
                    }
                }
                paths.retain(|p| {
                    !p.starts_with("stages") && !p.starts_with("links") && p != "description"
                });
            }
            for p in paths {
                checked += 1;
                if !config_keys.contains(&p) {
                    faults.push(format!("{at}: `{p}` is no key of configs/serve.yaml, configs/daemon.yaml or configs/default.yaml"));
                }
            }
        }
    }
    assert!(faults.is_empty(), "{}", faults.join("\n"));
    assert!(checked >= 20, "only {checked} YAML keys in the docs");
}

#[test]
fn every_relative_link_in_the_docs_resolves_and_the_readme_reaches_every_document() {
    let docs = documents();
    let mut faults = Vec::new();
    let mut links: HashMap<PathBuf, Vec<PathBuf>> = HashMap::new();
    for (path, text) in &docs {
        // Links outside code: `](target)`.
        let mut prose = String::new();
        let mut fenced = false;
        for l in text.lines() {
            if l.trim_start().starts_with("```") || l.trim_start().starts_with("~~~") {
                fenced = !fenced;
            } else if !fenced {
                prose.push_str(l);
                prose.push('\n');
            }
        }
        for piece in prose.split("](").skip(1) {
            let Some(target) = piece.split(')').next() else {
                continue;
            };
            let target = target.split_whitespace().next().unwrap_or("");
            if target.is_empty()
                || target.starts_with('#')
                || target.contains("://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let file = target.split('#').next().unwrap();
            let resolved = path.parent().unwrap().join(file);
            if !resolved.exists() {
                faults.push(format!("{}: link to {target}: no such file", name(path)));
            } else if let Ok(c) = resolved.canonicalize() {
                links
                    .entry(path.canonicalize().unwrap())
                    .or_default()
                    .push(c);
            }
        }
    }
    assert!(faults.is_empty(), "{}", faults.join("\n"));
    // Every document is reachable from the README.
    let readme = root().join("README.md").canonicalize().unwrap();
    let mut seen = BTreeSet::from([readme.clone()]);
    let mut todo = vec![readme];
    while let Some(p) = todo.pop() {
        for q in links.get(&p).into_iter().flatten() {
            if seen.insert(q.clone()) {
                todo.push(q.clone());
            }
        }
    }
    for (path, _) in &docs {
        assert!(
            seen.contains(&path.canonicalize().unwrap()),
            "{} is not reachable from README.md by links",
            name(path)
        );
    }
    let lines = docs[0..]
        .iter()
        .find(|(p, _)| p.ends_with("README.md") && p.parent() == Some(root()))
        .map(|(_, t)| t.lines().count())
        .unwrap();
    assert!(lines <= 250, "README.md has {lines} lines (at most 250)");
}

#[test]
fn the_checks_themselves_catch_what_they_are_for() {
    // A misspelt flag, an unknown subcommand and a wrapper's arguments are read as a user's
    // shell would.
    let cmds = duplex_commands(
        "RUST_LOG=info duplex serve --config x.yaml --chek \\\n  && target/release/duplex nope\ncargo run --release -- run p.yaml # comment --bogus\n",
    );
    assert_eq!(
        cmds,
        vec![
            vec!["serve", "--config", "x.yaml", "--chek"],
            vec!["nope"],
            vec!["run", "p.yaml"]
        ]
    );
    let serve = flags_of(&help(&["serve"]));
    assert!(serve.contains("--check") && !serve.contains("--chek"));
    // A block's language and text.
    let b = blocks("text\n```yaml title\na: 1\n```\n````sh\n```\n````\n");
    assert_eq!(
        (b[0].lang.as_str(), b[0].text.as_str(), b[0].line),
        ("yaml", "a: 1\n", 3)
    );
    assert_eq!((b[1].lang.as_str(), b[1].text.as_str()), ("sh", "```\n"));
    let mut p = BTreeSet::new();
    key_paths(
        &load_yaml("limits:\n  idle_timeout_s: 3\nstages: {a: {kind: x}}\n"),
        "",
        &mut p,
    );
    assert_eq!(
        p.into_iter().collect::<Vec<_>>(),
        ["limits", "limits.idle_timeout_s", "stages"]
    );
}
