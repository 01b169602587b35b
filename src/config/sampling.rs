//! The sampling settings the daemon's and the server's configurations share (`sampling:`): the
//! `depformer` stage's params of the same names, read once, with the stage's own types and
//! ranges (one definition, not a copy), into one typed value that both apps set over their
//! pipelines.

use config::Value;

use super::fields::Fields;
use super::params::{as_i64, ParamValue};
use super::{ConfigError, ConfigErrorKind, KindCatalog};

/// Every key of `sampling:`.
pub const KEYS: [&str; 10] = [
    "text_temperature",
    "text_top_k",
    "audio_temperature",
    "audio_top_k",
    "pad_mult",
    "repetition_penalty",
    "repetition_penalty_context",
    "seed",
    "text_seed",
    "audio_seed",
];

/// Sampling settings (the semantics are the depformer stage's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Text temperature (0 = greedy).
    pub text_temperature: f64,
    /// Text top-k.
    pub text_top_k: i64,
    /// Audio temperature (0 = greedy).
    pub audio_temperature: f64,
    /// Audio top-k.
    pub audio_top_k: i64,
    /// Kyutai's padding multiplier: the text padding token's probability times e^pad_mult (0 =
    /// off).
    pub pad_mult: f64,
    /// Kyutai's repetition penalty of the text (1 = off).
    pub repetition_penalty: f64,
    /// Non-padding text tokens the repetition penalty looks back over.
    pub repetition_penalty_context: i64,
    /// The default of both samplers' seeds (the text sampler takes it, the audio sampler a fixed
    /// derivation of it); `None` (`-1`, where the app allows it): a fresh one for each
    /// conversation.
    pub seed: Option<u64>,
    /// The text sampler's own seed; `None` (`-1`): from `seed`.
    pub text_seed: Option<u64>,
    /// The audio sampler's own seed; `None` (`-1`): from `seed`.
    pub audio_seed: Option<u64>,
}

impl Sampling {
    /// Reads the table `s` (`sampling:`), every key checked as the `depformer` stage of
    /// `catalog` checks its param of that name. `fresh_seed` lets `seed` be `-1` (a fresh
    /// seed per conversation: the server's sessions); otherwise it is the stage's range.
    ///
    /// # Errors
    ///
    /// An unknown key (with a suggestion), a missing one, a wrong type or a value out of the
    /// stage's range, naming the key.
    pub fn read(
        s: &Fields<'_>,
        catalog: &dyn KindCatalog,
        fresh_seed: bool,
    ) -> Result<Sampling, ConfigError> {
        s.known(&KEYS)?;
        let value = |k: &str| -> Result<&Value, ConfigError> {
            s.get(k).ok_or_else(|| {
                s.err(
                    ConfigErrorKind::Missing,
                    k,
                    "missing (the built-in defaults have it)",
                )
            })
        };
        let num = |k: &str| s.param_value(catalog, "depformer", k, value(k)?);
        // Integers as the stage takes them (a seed may pass 2^53: no trip through f64).
        let int = |k: &str| -> Result<i64, ConfigError> {
            num(k)?;
            Ok(value(k).ok().and_then(as_i64).unwrap_or_default())
        };
        let seed = |k: &str, fresh: bool| -> Result<Option<u64>, ConfigError> {
            if fresh && value(k).ok().and_then(as_i64) == Some(-1) {
                return Ok(None);
            }
            Ok(u64::try_from(int(k)?).ok())
        };
        Ok(Sampling {
            text_temperature: num("text_temperature")?,
            text_top_k: int("text_top_k")?,
            audio_temperature: num("audio_temperature")?,
            audio_top_k: int("audio_top_k")?,
            pad_mult: num("pad_mult")?,
            repetition_penalty: num("repetition_penalty")?,
            repetition_penalty_context: int("repetition_penalty_context")?,
            seed: seed("seed", fresh_seed)?,
            text_seed: seed("text_seed", true)?,
            audio_seed: seed("audio_seed", true)?,
        })
    }

    /// The depformer's params these settings set, seeds included where given (a seed left
    /// to the stage is `-1` for `text_seed` and `audio_seed`, absent for `seed`).
    pub fn params(&self) -> Vec<(&'static str, ParamValue)> {
        use ParamValue::{Float, Int};
        let seed = |s: Option<u64>| Int(s.map_or(-1, |v| v.min(i64::MAX as u64) as i64));
        let mut v = vec![
            ("text_temperature", Float(self.text_temperature)),
            ("text_top_k", Int(self.text_top_k)),
            ("audio_temperature", Float(self.audio_temperature)),
            ("audio_top_k", Int(self.audio_top_k)),
            ("pad_mult", Float(self.pad_mult)),
            ("repetition_penalty", Float(self.repetition_penalty)),
            (
                "repetition_penalty_context",
                Int(self.repetition_penalty_context),
            ),
        ];
        if let Some(s) = self.seed {
            v.push(("seed", Int(s.min(i64::MAX as u64) as i64)));
        }
        v.push(("text_seed", seed(self.text_seed)));
        v.push(("audio_seed", seed(self.audio_seed)));
        v
    }

    /// The three seeds: a change of one restarts a random stream (the daemon rebuilds its
    /// pipeline for it).
    pub fn seeds(&self) -> (Option<u64>, Option<u64>, Option<u64>) {
        (self.seed, self.text_seed, self.audio_seed)
    }

    /// Every setting but the seeds as the depformer's `sampling` command takes them
    /// (`key=value …`): what a running pipeline can change without a rebuild.
    pub fn command_arg(&self) -> String {
        self.params()
            .iter()
            .filter(|(k, _)| !k.ends_with("seed"))
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::params::{ParamDefault, ParamSpec, ParamType};

    /// A catalog with the depformer's sampling params as the stage declares their types.
    struct Depformer(Vec<ParamSpec>);

    impl KindCatalog for Depformer {
        fn params(&self, kind: &str) -> Option<&[ParamSpec]> {
            (kind == "depformer").then_some(&self.0[..])
        }
        fn kind_names(&self) -> Vec<&str> {
            vec!["depformer"]
        }
    }

    fn catalog() -> Depformer {
        let f = |name, min, max| ParamSpec {
            name,
            ty: ParamType::Float { min, max },
            default: ParamDefault::Float(min),
            doc: "",
        };
        let i = |name, min, max| ParamSpec {
            name,
            ty: ParamType::Int { min, max },
            default: ParamDefault::Int(min),
            doc: "",
        };
        Depformer(vec![
            f("text_temperature", 0.0, 100.0),
            i("text_top_k", 0, 1 << 20),
            f("audio_temperature", 0.0, 100.0),
            i("audio_top_k", 0, 1 << 20),
            f("pad_mult", -10.0, 10.0),
            f("repetition_penalty", 1.0, 10.0),
            i("repetition_penalty_context", 0, 4096),
            i("seed", 0, i64::MAX),
            i("text_seed", -1, i64::MAX),
            i("audio_seed", -1, i64::MAX),
        ])
    }

    fn read(extra: &str, fresh: bool) -> Result<Sampling, ConfigError> {
        let text = format!(
            "text_temperature: 0.7\ntext_top_k: 25\naudio_temperature: 0.8\naudio_top_k: 250\n\
             repetition_penalty: 1.0\nrepetition_penalty_context: 64\n\
             text_seed: -1\naudio_seed: 9007199254740993\n{extra}"
        );
        let map = crate::yaml::parse(&text, "s.yaml", crate::yaml::Limits::FILES).unwrap();
        Sampling::read(&Fields::new("s.yaml", "defaults", &map), &catalog(), fresh)
    }

    #[test]
    fn seeds_are_read_exactly_and_a_fresh_seed_only_where_the_app_allows_one() {
        let s = read("pad_mult: 0\nseed: -1\n", true).unwrap();
        assert_eq!(s.seeds(), (None, None, Some(9_007_199_254_740_993)));
        let e = read("pad_mult: 0\nseed: -1\n", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`seed`") && e.contains("out of range 0..="),
            "{e}"
        );
        let s = read("pad_mult: 0\nseed: 7\n", false).unwrap();
        assert_eq!(s.seed, Some(7));
        let params = s.params();
        assert!(params.contains(&("seed", ParamValue::Int(7))));
        assert!(params.contains(&("text_seed", ParamValue::Int(-1))));
        assert_eq!(
            s.command_arg(),
            "text_temperature=0.7 text_top_k=25 audio_temperature=0.8 audio_top_k=250 \
             pad_mult=0 repetition_penalty=1 repetition_penalty_context=64"
        );
    }

    #[test]
    fn values_are_checked_by_the_stages_own_ranges_naming_the_key() {
        let e = read("seed: 1\npad_mult: 12\n", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`pad_mult`") && e.contains("12 is out of range -10..=10"),
            "{e}"
        );
        let e = read("pad_mult: 0\nseed: 1\nsede: 2\n", false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`sede`: unknown key"), "{e}");
        let e = read("pad_mult: 0\n", false).unwrap_err().to_string();
        assert!(e.contains("`seed`") && e.contains("missing"), "{e}");
    }
}
