//! Persona text through SentencePiece, and transcripts assembled piece by piece.

use crate::support;
use crate::support::packs;

use std::path::{Path, PathBuf};
use std::process::Command;

use duplex::model::tokenizer::{Tokenizer, Transcript};

fn model() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tokenizer-tiny.model");
    assert!(
        p.is_file(),
        "run `make setup` (it trains models/tokenizer-tiny.model)"
    );
    p
}

fn python_ids(text: &str) -> Vec<i64> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let o = Command::new(root.join(".venv/bin/python"))
        .args([
            "-c",
            "import sys, sentencepiece as s; print(','.join(map(str, s.SentencePieceProcessor(model_file=sys.argv[1]).encode(sys.argv[2]))))",
        ])
        .arg(model())
        .arg(text)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout)
        .trim()
        .split(',')
        .map(|t| t.parse().unwrap())
        .collect()
}

const PERSONA: &str = "You are a wise and friendly teacher in Zürich!";

#[test]
fn persona_text_is_wrapped_and_encoded_like_sentencepiece_does() {
    let t = Tokenizer::open(&model()).unwrap();
    let ids = t.encode_persona(PERSONA).unwrap();
    assert_eq!(ids, python_ids(&format!("<system> {PERSONA} <system>")));
    // Already wrapped: not wrapped twice.
    assert_eq!(
        t.encode_persona(&format!("<system> {PERSONA} <system>"))
            .unwrap(),
        ids
    );
}

/// Text of every kind a persona or a user may write (letters with and without accents,
/// combining marks, full-width forms, CJK, emoji, ligatures, spaces, tabs and control
/// characters, runs of spaces) encodes to the ids of SentencePiece's own library, 2000 strings.
#[test]
fn any_text_encodes_to_the_ids_of_sentencepieces_own_library() {
    let pools: [&str; 13] = [
        "abcdefghijklmnopqrstuvwxyz",
        "ABCDEFGHIJ",
        "   \t",
        "0123456789",
        ".,;:!?'\"-()[]<>/",
        "éèàüöñçßøåÆŒ",
        "日本語中文한국어",
        "ｆｕｌｌＡＢＣ１２３",
        "\u{301}\u{308}\u{200b}\u{a0}\u{3000}",
        "🙂🚀👍🏽",
        "½™©®°",
        "ﬁﬂ",
        "\u{0}\u{7}\u{1f}",
    ];
    // A fixed generator (xorshift): the same strings every run.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as usize
    };
    let texts: Vec<String> = (0..2000)
        .map(|_| {
            let len = next(41);
            (0..len)
                .map(|_| {
                    let pool: Vec<char> = pools[next(pools.len())].chars().collect();
                    pool[next(pool.len())]
                })
                .collect()
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("texts.json");
    std::fs::write(&file, serde_json::to_vec(&texts).unwrap()).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let o = Command::new(root.join(".venv/bin/python"))
        .args([
            "-c",
            "import sys, json, sentencepiece as s; p = s.SentencePieceProcessor(model_file=sys.argv[1]); print(json.dumps([p.encode(t) for t in json.load(open(sys.argv[2]))]))",
        ])
        .arg(model())
        .arg(&file)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want: Vec<Vec<i64>> = serde_json::from_slice(&o.stdout).unwrap();
    let t = Tokenizer::open(&model()).unwrap();
    for (text, want) in texts.iter().zip(&want) {
        assert_eq!(&t.encode(text).unwrap(), want, "{text:?}");
    }
}

#[test]
fn a_transcript_rebuilds_the_text_including_byte_fallback() {
    let t = Tokenizer::open(&model()).unwrap();
    let ids = t.encode(PERSONA).unwrap();
    let mut tr = Transcript::new();
    let mut text = String::new();
    let mut silent = 0;
    for &id in &ids {
        match tr.push(&t, id) {
            Some(p) => text.push_str(&p),
            None => silent += 1,
        }
    }
    assert_eq!(text.trim(), PERSONA);
    assert!(silent >= 1, "the first byte of `ü` waits for the second");
    // Control tokens (padding) and ids beyond the vocabulary add nothing.
    assert_eq!(tr.push(&t, 3), None);
    assert_eq!(tr.push(&t, 31_999), None);
    assert!(Tokenizer::open(Path::new("/nonexistent.model")).is_err());
}

#[test]
fn replay_with_persona_text_equals_replay_with_its_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let codes = dir.path().join("codes.json");
    std::fs::write(
        &codes,
        "[[1,2,3,4,5,6,7,8],[9,10,11,12,13,14,15,16],[17,18,19,20,21,22,23,24]]",
    )
    .unwrap();
    let ids: Vec<String> = python_ids(&format!("<system> {PERSONA} <system>"))
        .iter()
        .map(|i| i.to_string())
        .collect();
    let run = |out: &str, extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args(["replay", "--greedy", "--pack"])
            .arg(packs::pack("tiny-gqa"))
            .arg("--codes")
            .arg(&codes)
            .arg("--out")
            .arg(dir.path().join(out))
            .args(extra)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let m = model();
    let (rc, err) = run(
        "a",
        &["--persona", PERSONA, "--tokenizer", m.to_str().unwrap()],
    );
    assert_eq!(rc, Some(0), "{err}");
    let (rc, err) = run("b", &["--persona-tokens", &ids.join(",")]);
    assert_eq!(rc, Some(0), "{err}");
    let a = std::fs::read_to_string(dir.path().join("a")).unwrap();
    let b = std::fs::read_to_string(dir.path().join("b")).unwrap();
    assert_eq!(a, b);
    // Against no persona at all, the priming changes the conversation.
    let (rc, _) = run("c", &[]);
    assert_eq!(rc, Some(0));
    assert_ne!(a, std::fs::read_to_string(dir.path().join("c")).unwrap());

    let (rc, err) = run("d", &["--persona", PERSONA]);
    assert_eq!(rc, Some(2));
    assert!(err.contains("`persona` text needs a tokenizer"), "{err}");
    let (rc, err) = run(
        "e",
        &[
            "--persona",
            PERSONA,
            "--persona-tokens",
            "1,2",
            "--tokenizer",
            m.to_str().unwrap(),
        ],
    );
    assert_eq!(rc, Some(2));
    assert!(
        err.contains("give `persona` or `persona_tokens`, not both"),
        "{err}"
    );
}

#[test]
fn token_sink_writes_the_piece_when_there_is_one() {
    use duplex::runtime::*;
    use duplex::stages::AgentTokens;
    struct Src(Vec<AgentTokens>);
    impl Source for Src {
        fn produce(&mut self, cx: &mut Context<'_>) -> StageResult<Flow> {
            if self.0.is_empty() {
                return Ok(Flow::Done);
            }
            let t = self.0.remove(0);
            cx.emit(0, std::time::Instant::now(), t)?;
            Ok(Flow::Continue)
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.jsonl");
    let sink = support::build_stage("token_sink", "sink", &[("path", out.to_str().unwrap())]);
    let frames = vec![
        AgentTokens {
            index: 0,
            text: 3,
            audio: vec![1; 8],
            piece: None,
        },
        AgentTokens {
            index: 1,
            text: 57,
            audio: vec![2; 8],
            piece: Some(" teacher".into()),
        },
    ];
    PipelineBuilder::new()
        .source(
            "src",
            "test",
            vec![PortSpec::new::<AgentTokens>("out")],
            Src(frames),
        )
        .node(sink)
        .link(Link::new("src", "sink"))
        .build()
        .unwrap()
        .run()
        .unwrap();
    let text = std::fs::read_to_string(&out).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0],
        r#"{"frame":0,"text":3,"audio":[1,1,1,1,1,1,1,1]}"#
    );
    assert_eq!(
        lines[1],
        r#"{"frame":1,"text":57,"audio":[2,2,2,2,2,2,2,2],"piece":" teacher"}"#
    );
}
