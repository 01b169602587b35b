//! The metrics as an operator sees them: a real Prometheus (the Debian package) scrapes a running
//! `duplex run` with contention or growth injected; every PromQL expression of the Grafana
//! dashboard and of the rules evaluates without error (and with data where the pipeline has
//! it), and the verdict series shows the injected pattern. `promtool` checks the deployment
//! files and runs their unit tests; the Kubernetes manifests pass their schema, and
//! deploy/compose.yaml mounts files that exist and its Prometheus scrapes a real server with its
//! key.

use crate::support::packs;
use crate::support::serve;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    buf.split_once("\r\n\r\n").map(|(_, b)| b.to_string())
}

fn query(port: u16, expr: &str) -> serde_json::Value {
    let body =
        get(port, &format!("/api/v1/query?query={}", encode(expr))).expect("prometheus answers");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn promtool(args: &[&str]) {
    let o = Command::new("promtool")
        .args(args)
        .current_dir(root().join("deploy/prometheus"))
        .output()
        .expect("promtool (run `make setup`)");
    assert!(
        o.status.success(),
        "promtool {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn promtool_accepts_the_config_and_the_rules_and_their_tests_pass() {
    promtool(&["check", "config", "prometheus.yml"]);
    promtool(&["check", "rules", "rules.yml"]);
    promtool(&["test", "rules", "rules_test.yml"]);
}

/// Whether a dashboard or rule expression is about network sessions or the shared LM engine and
/// codec (data only from `duplex serve`, whose default template runs them).
fn about_sessions(e: &str) -> bool {
    e.contains("duplex_session")
        || e.contains("duplex_opus")
        || e.contains("path=\"server\"")
        || e.contains("duplex_engine")
        || e.contains("duplex_codec")
        || e.contains("duplex_webrtc")
}

/// Whether a dashboard expression is about an echo canceller (data only from a pipeline with a
/// sound card and an `aec` stage: the daemon's test reads those series from its `/metrics`).
fn about_echo(e: &str) -> bool {
    e.contains("duplex_aec")
}

/// The dashboard's expressions (with `$stage` as all stages): (pipeline ones, session ones,
/// echo canceller ones).
fn panel_expressions() -> (Vec<String>, Vec<String>, Vec<String>) {
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/grafana/dashboards/duplex.json")).unwrap(),
    )
    .unwrap();
    let (mut pipeline, mut sessions, mut echo) = (Vec::new(), Vec::new(), Vec::new());
    for p in dash["panels"].as_array().unwrap() {
        // Rows have no targets.
        for t in p["targets"].as_array().into_iter().flatten() {
            let e = t["expr"].as_str().unwrap().replace("$stage", ".*");
            if about_sessions(&e) {
                sessions.push(e);
            } else if about_echo(&e) {
                echo.push(e);
            } else {
                pipeline.push(e);
            }
        }
    }
    assert!(pipeline.len() >= 20 && sessions.len() >= 10 && echo.len() >= 4);
    (pipeline, sessions, echo)
}

/// Every expression of the dashboard (pipeline panels) and of the rules: (panels, records,
/// alerts).
fn expressions() -> (Vec<String>, Vec<String>, Vec<String>) {
    let (panels, _, _) = panel_expressions();
    let rules = std::fs::read_to_string(root().join("deploy/prometheus/rules.yml")).unwrap();
    let (mut records, mut alerts) = (Vec::new(), Vec::new());
    let mut kind = "";
    for line in rules.lines() {
        let l = line.trim();
        if l.starts_with("- record:") {
            kind = "record";
        } else if l.starts_with("- alert:") {
            kind = "alert";
        } else if let Some(e) = l.strip_prefix("expr: ") {
            if kind == "record" {
                records.push(e.to_string());
            } else {
                alerts.push(e.to_string());
            }
        }
    }
    assert!(records.len() >= 9 && alerts.len() == 7);
    (panels, records, alerts)
}

fn pipeline(dir: &Path, injected: &str) -> PathBuf {
    let pack = packs::pack("tiny-gqa");
    let pk = pack.display();
    let text = format!(
        r#"
stages:
  tone: {{ kind: synth_source, rate: 24000, duration: 600, realtime: true, chunk_ms: 80 }}
  work: {{ kind: inject_delay, {injected} }}
  framer: {{ kind: framer }}
  encode: {{ kind: mimi_encode, pack: {pk} }}
  temporal: {{ kind: temporal, pack: {pk} }}
  depformer: {{ kind: depformer, pack: {pk} }}
  decode: {{ kind: mimi_decode, pack: {pk} }}
  speaker: {{ kind: playback, device: virtual }}
links:
  - tone -> work
  - work -> framer
  - framer -> encode
  - encode -> temporal.codes
  - temporal.step -> depformer
  - {{ from: depformer, to: temporal.tokens, feedback: true }}
  - temporal.agent -> decode
  - decode -> speaker
metrics:
  window: 64
  every: 8
"#
    );
    let p = dir.join("p.yaml");
    std::fs::write(&p, text).unwrap();
    p
}

fn scrape_run(injected: &str, want: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (mport, pport) = (free_port(), free_port());
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: duplex\n    static_configs:\n      - targets: [\"127.0.0.1:{mport}\"]\n",
        root().join("deploy/prometheus/rules.yml").display()
    );
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    let _prom = Kill(
        Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{pport}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus (run `make setup`)"),
    );
    let p = pipeline(dir.path(), injected);
    let _duplex = Kill(
        Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args([
                "run",
                p.to_str().unwrap(),
                "--set",
                &format!("metrics.address=127.0.0.1:{mport}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Wait until the verdict shows up (or give up after 60 s).
    let verdict = format!("duplex_latency_pattern{{stage=\"work\",pattern=\"{want}\"}} == 1");
    let t0 = Instant::now();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let r = get(pport, &format!("/api/v1/query?query={}", encode(&verdict)));
        let found = r
            .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok())
            .is_some_and(|v| {
                v["data"]["result"]
                    .as_array()
                    .is_some_and(|a| !a.is_empty())
            });
        if found && t0.elapsed() > Duration::from_secs(12) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no {want} verdict for stage `work` within 60 s"
        );
    }
    let (panels, records, alerts) = expressions();
    for e in panels.iter().chain(&records).filter(|e| !about_sessions(e)) {
        // A loaded machine may delay a scrape or a rule's evaluation past the moment asked:
        // the expression must have data within 15 s.
        let t0 = Instant::now();
        loop {
            let v = query(pport, e);
            assert_eq!(v["status"], "success", "{e}: {v}");
            let n = v["data"]["result"].as_array().map(|a| a.len()).unwrap_or(0);
            if n > 0 {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(15), "no data for {e}");
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    let (_, _, echo) = panel_expressions();
    for e in alerts.iter().chain(&echo) {
        let v = query(pport, e);
        assert_eq!(v["status"], "success", "{e}: {v}");
    }
    // The other verdict is not set on the injected stage, and cheap stages stay steady.
    let other = if want == "growth" {
        "contention"
    } else {
        "growth"
    };
    let v = query(
        pport,
        &format!("duplex_latency_pattern{{stage=\"work\",pattern=\"{other}\"}} == 1"),
    );
    assert_eq!(
        v["data"]["result"].as_array().map(|a| a.len()),
        Some(0),
        "{v}"
    );
    let v = query(
        pport,
        "duplex_latency_pattern{stage=\"tone\",pattern=\"steady\"} == 1",
    );
    assert_eq!(
        v["data"]["result"].as_array().map(|a| a.len()),
        Some(1),
        "{v}"
    );
}

#[test]
fn prometheus_sees_contention() {
    scrape_run(
        "mode: bimodal, base_ms: 4, slow_ms: 40, slow_fraction: 0.08",
        "contention",
    );
}

#[test]
fn prometheus_sees_growth() {
    scrape_run(
        "mode: ramp, base_ms: 2, ramp_to_ms: 40, ramp_frames: 600",
        "growth",
    );
}

/// Starts a Prometheus that scrapes `target` every second with the deployment's rules.
fn prometheus(dir: &Path, target: u16) -> (Kill, u16) {
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: duplex\n    static_configs:\n      - targets: [\"127.0.0.1:{target}\"]\n",
        root().join("deploy/prometheus/rules.yml").display()
    );
    start_prometheus(dir, &config)
}

/// Starts a Prometheus on a free port with `config` (written to `dir/prometheus.yml`, its data
/// in `dir/data`).
fn start_prometheus(dir: &Path, config: &str) -> (Kill, u16) {
    let pport = free_port();
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    let child = Command::new("prometheus")
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{pport}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("prometheus (run `make setup`)");
    (Kill(child), pport)
}

/// The prometheus-adapter rule's `metricsQuery` of deploy/kubernetes, with the adapter's
/// template filled in as it would be for the pods of job `duplex`.
fn adapter_query() -> String {
    let text =
        std::fs::read_to_string(root().join("deploy/kubernetes/prometheus-adapter.yaml")).unwrap();
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("metricsQuery: "))
        .expect("the adapter rule has a metricsQuery");
    line.trim_matches('\'')
        .replace("<<.LabelMatchers>>", "job=\"duplex\"")
        .replace("<<.GroupBy>>", "instance")
}

#[test]
fn prometheus_scrapes_duplex_serve_and_the_autoscaler_metric_counts_slots() {
    let server = serve::Server::start("max_sessions: 2\n", 240);
    let (_prom, pport) = prometheus(server.dir.path(), server.port);
    let url = server.url();
    // A short session with a message of an unknown kind, ended; then both slots held, and one
    // client refused.
    serve::client(
        &url,
        &["--send-raw", "09aa", "--silent", "1", "--tail", "0"],
    );
    let holders: Vec<_> = (0..2)
        .map(|_| {
            Kill(
                serve::client_command(&url, &["--silent", "40", "--tail", "0"])
                    .spawn()
                    .unwrap(),
            )
        })
        .collect();
    server.wait_sessions(2, 20);
    let refused = serve::client(&url, &["--silent", "0.2"]);
    assert_eq!(refused["refused"]["status"], 503, "{refused}");
    // The autoscaler's metric: 2 of 2 slots in use.
    let q = adapter_query();
    let t0 = Instant::now();
    let utilization = loop {
        let v = query(pport, &q);
        assert_eq!(v["status"], "success", "{q}: {v}");
        let value = v["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|x| x.parse::<f64>().ok());
        match value {
            Some(x) if x > 0.9 => break x,
            _ => {}
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{q}: {v}");
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(utilization, 1.0);
    // Each panel's expression has data once enough scrapes are in for its rates.
    let (_, sessions, _) = panel_expressions();
    for e in &sessions {
        crate::support::wait::wait_until(Duration::from_secs(30), &format!("data for {e}"), || {
            let v = query(pport, e);
            assert_eq!(v["status"], "success", "{e}: {v}");
            v["data"]["result"]
                .as_array()
                .is_some_and(|a| !a.is_empty())
        });
    }
    // The sessions' verdicts and real-time factor, published together by the server.
    let v = query(
        pport,
        "duplex_latency_pattern{stage=\"temporal\",pattern=\"steady\"} == 1",
    );
    assert_eq!(
        v["data"]["result"].as_array().map(|a| a.len()),
        Some(1),
        "{v}"
    );
    let v = query(pport, "duplex_realtime_factor > 0");
    assert_eq!(
        v["data"]["result"].as_array().map(|a| a.len()),
        Some(1),
        "{v}"
    );
    let v = query(pport, "duplex:sessions:utilization");
    assert_eq!(v["data"]["result"][0]["value"][1], "1", "{v}");
    let (_, _, alerts) = expressions();
    for e in &alerts {
        assert_eq!(query(pport, e)["status"], "success", "{e}");
    }
    drop(holders);
}

#[test]
fn the_kubernetes_manifests_pass_the_schema_and_a_broken_one_does_not() {
    let validate = root().join(".venv/bin/kubernetes-validate");
    let dir = root().join("deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "{files:?}");
    let run = |files: &[PathBuf]| {
        Command::new(&validate)
            .args(["--strict", "-k", "1.37.0"])
            .args(files)
            .output()
            .expect("kubernetes-validate (run `make setup`)")
    };
    let out = run(&files);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The probes, the drain and the autoscaler agree with the server's configuration.
    let deployment = std::fs::read_to_string(dir.join("statefulset.yaml")).unwrap();
    let configmap = std::fs::read_to_string(dir.join("configmap.yaml")).unwrap();
    assert!(deployment.contains("path: /readyz") && deployment.contains("path: /healthz"));
    let drain: u64 = configmap
        .lines()
        .find_map(|l| l.trim().strip_prefix("drain_timeout_s: "))
        .unwrap()
        .parse()
        .unwrap();
    let grace: u64 = deployment
        .lines()
        .find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds: "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        grace > drain + 5,
        "grace {grace} s does not cover a {drain} s drain"
    );
    // Each pod the autoscaler may run has its route (its calls' hang-ups reach it), and each
    // pod names its own path.
    let hpa = std::fs::read_to_string(dir.join("hpa.yaml")).unwrap();
    let most: usize = hpa
        .lines()
        .find_map(|l| l.trim().strip_prefix("maxReplicas: "))
        .unwrap()
        .parse()
        .unwrap();
    let routes = std::fs::read_to_string(dir.join("replicas.yaml")).unwrap();
    for pod in 0..most {
        assert!(
            routes.contains(&format!(
                "statefulset.kubernetes.io/pod-name: duplex-{pod}\n"
            )) && routes.contains(&format!("path: /replica/duplex-{pod}/\n")),
            "no route to pod duplex-{pod} of {most}"
        );
    }
    assert!(deployment.contains("value: \"/replica/$(POD_NAME)\""));
    // A typo is caught.
    let scratch = tempfile::tempdir().unwrap();
    let broken = scratch.path().join("statefulset.yaml");
    std::fs::write(&broken, deployment.replace("replicas: 1", "replica: 1")).unwrap();
    assert!(!run(&[broken]).status.success(), "a misspelt field passed");
}

/// The source of a volume of deploy/compose.yaml (`SOURCE:TARGET[:MODE]`), with
/// `${VAR:-default}` read as its default.
fn compose_source(volume: &str) -> String {
    match volume
        .strip_prefix("${")
        .and_then(|r| r.split_once('}'))
        .and_then(|(var, _)| var.split_once(":-"))
    {
        Some((_, default)) => default.to_string(),
        None => volume.split(':').next().unwrap().to_string(),
    }
}

#[test]
fn the_compose_file_mounts_files_that_exist_and_its_prometheus_scrapes_the_server_with_its_key() {
    use yaml_rust2::{Yaml, YamlLoader};
    let deploy = root().join("deploy");
    let text = std::fs::read_to_string(deploy.join("compose.yaml")).unwrap();
    let doc = YamlLoader::load_from_str(&text).unwrap().remove(0);
    let services = &doc["services"];
    for name in ["duplex", "prometheus", "grafana"] {
        assert!(!services[name].is_badvalue(), "no service {name}");
    }
    // The server is built from the repository's Containerfile, as the image the manifests run.
    let duplex = &services["duplex"];
    let context = deploy.join(duplex["build"]["context"].as_str().unwrap());
    assert!(context
        .join(duplex["build"]["dockerfile"].as_str().unwrap())
        .is_file());
    let image = format!("duplex:{}", env!("CARGO_PKG_VERSION"));
    assert_eq!(duplex["image"].as_str(), Some(image.as_str()));
    let deployment = std::fs::read_to_string(deploy.join("kubernetes/statefulset.yaml")).unwrap();
    assert!(
        deployment.contains(&format!("image: {image}")),
        "the Deployment runs another image than {image}"
    );
    // Every file or folder a service mounts from the repository exists.
    let named: Vec<&str> = doc["volumes"]
        .as_hash()
        .unwrap()
        .keys()
        .filter_map(Yaml::as_str)
        .collect();
    let mut mounts = 0;
    for (_, service) in services.as_hash().unwrap() {
        for v in service["volumes"].as_vec().into_iter().flatten() {
            let source = compose_source(v.as_str().unwrap());
            if named.contains(&source.as_str()) {
                continue;
            }
            mounts += 1;
            let path = deploy.join(&source);
            // (models/ is what `make setup` builds.)
            assert!(path.exists(), "{v:?}: {} does not exist", path.display());
        }
    }
    assert!(mounts >= 5, "{mounts} mounts");
    let secret = doc["secrets"]["metrics_key"]["file"].as_str().unwrap();
    let ignored = std::fs::read_to_string(root().join(".gitignore")).unwrap();
    assert!(
        ignored
            .lines()
            .any(|l| deploy.join(secret).ends_with(l.trim_start_matches('/'))),
        "the key file {secret} is not ignored by git"
    );
    let datasource =
        std::fs::read_to_string(deploy.join("compose/grafana-datasource.yml")).unwrap();
    assert!(datasource.contains("url: http://prometheus:9090"));
    // (The dashboard picks any data source of type prometheus: this one is the default.)
    assert!(datasource.contains("type: prometheus") && datasource.contains("isDefault: true"));

    // Its Prometheus configuration, pointed at a real server whose keys file holds Prometheus's
    // key: the scrape succeeds with the key, and /metrics refuses a request without it.
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("metrics-key");
    serve::write_keys(
        &key_file,
        "5f0c1d9e8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b\n",
    );
    let server = serve::Server::start(&format!("keys_file: {}\n", key_file.display()), 240);
    let (status, _) = server.get("/metrics");
    assert_eq!(status, 401, "/metrics answered without a key");
    let config = std::fs::read_to_string(deploy.join("prometheus/compose.yml"))
        .unwrap()
        .replace("/run/secrets/metrics_key", &key_file.display().to_string())
        .replace("duplex:8998", &format!("127.0.0.1:{}", server.port))
        .replace("scrape_interval: 5s", "scrape_interval: 1s")
        .replace(
            "- rules.yml",
            &format!("- {}", deploy.join("prometheus/rules.yml").display()),
        );
    assert!(config.contains(&key_file.display().to_string()) && config.contains("127.0.0.1:"));
    let pdir = keys.path().join("prometheus");
    std::fs::create_dir(&pdir).unwrap();
    let (_prom, pport) = start_prometheus(&pdir, &config);
    let scraped = "up{job=\"duplex\"} == 1 and on() duplex_sessions_capacity > 0";
    serve::wait::wait_until(
        Duration::from_secs(40),
        "Prometheus to scrape the server with the key",
        || {
            get(pport, &format!("/api/v1/query?query={}", encode(scraped)))
                .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok())
                .and_then(|v| v["data"]["result"].as_array().map(|a| !a.is_empty()))
                .unwrap_or(false)
        },
    );
}
