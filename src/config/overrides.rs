//! Typed params set over an already loaded pipeline: how a server makes each session's pipeline
//! from the session template it holds in memory (the client's sampling, persona and voice, the
//! operator's pack), without reading the file again or writing values out as text.
//!
//! Each value is checked against its stage kind's declared params exactly as a value of the
//! file is (type, range, choices), and keeps where it came from for messages.
//!
//! [`PipelineSpec::merge_pair`] makes two linked stages one of another kind: how the server
//! gives a transport that carries PCM the same template as one that carries Ogg/Opus.

use config::{Value, ValueKind};

use super::params::{check, ParamValue};
use super::{ConfigError, ConfigErrorKind, KindCatalog, PipelineSpec};

/// One param set over a loaded pipeline's.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamOverride {
    /// The stage's name.
    pub stage: String,
    /// The param.
    pub param: &'static str,
    /// Its value.
    pub value: ParamValue,
    /// Who set it, for messages (`query text_temperature=0.5`, `serve.yaml: pack`).
    pub origin: String,
}

impl ParamOverride {
    /// `param` of `stage` set to `value` by `origin`.
    pub fn new(
        stage: impl Into<String>,
        param: &'static str,
        value: ParamValue,
        origin: impl Into<String>,
    ) -> Self {
        ParamOverride {
            stage: stage.into(),
            param,
            value,
            origin: origin.into(),
        }
    }
}

fn raw(v: &ParamValue, origin: Option<&String>) -> Value {
    let kind = match v {
        ParamValue::Bool(b) => ValueKind::Boolean(*b),
        ParamValue::Int(i) => ValueKind::I64(*i),
        ParamValue::Float(x) => ValueKind::Float(*x),
        ParamValue::Str(s) => ValueKind::String(s.clone()),
        ParamValue::IntList(l) => ValueKind::Array(
            l.iter()
                .map(|i| Value::new(None, ValueKind::I64(*i)))
                .collect(),
        ),
    };
    Value::new(origin, kind)
}

impl PipelineSpec {
    /// This pipeline with `overrides` set over its params, each checked as a value of the file
    /// is; the rest is shared as it is.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the stage, the param and the override's origin: no such stage,
    /// or a value the stage's kind refuses.
    pub fn with_overrides(
        &self,
        catalog: &dyn KindCatalog,
        overrides: &[ParamOverride],
    ) -> Result<PipelineSpec, ConfigError> {
        let mut spec = self.clone();
        for stage in &mut spec.stages {
            let mine: Vec<&ParamOverride> =
                overrides.iter().filter(|o| o.stage == stage.name).collect();
            if mine.is_empty() {
                continue;
            }
            let specs = catalog.params(&stage.kind).ok_or_else(|| {
                ConfigError::new(&self.file, ConfigErrorKind::UnknownKind, "unknown kind")
                    .stage(stage.name.clone())
            })?;
            let mut values: Vec<(String, Value)> = stage
                .params
                .iter()
                .filter(|(k, _)| !mine.iter().any(|o| o.param == *k))
                .map(|(k, v)| {
                    let origin = stage.params.origin(k).map(str::to_string);
                    (k.to_string(), raw(v, origin.as_ref()))
                })
                .collect();
            for o in &mine {
                values.push((o.param.to_string(), raw(&o.value, Some(&o.origin))));
            }
            stage.params = check(&self.file, &stage.name, &stage.kind, specs, &values)?;
        }
        if let Some(o) = overrides
            .iter()
            .find(|o| !spec.stages.iter().any(|s| s.name == o.stage))
        {
            return Err(ConfigError::new(
                &self.file,
                ConfigErrorKind::Build,
                format!(
                    "{}: no stage `{}` to set `{}` on",
                    o.origin, o.stage, o.param
                ),
            ));
        }
        Ok(spec)
    }

    /// A copy with the stages `first` and `second`, linked `first -> second` by their only
    /// link (`first`'s only output, `second`'s only input), made one stage of `kind` named
    /// `keep` (one of the two names): the links into `first` and out of `second` are its, and
    /// each param of the two that `kind` declares carries over (`second`'s wins), checked as a
    /// file's value is.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the file and the stage when the two are not so linked, or a
    /// carried value does not suit `kind`.
    pub fn merge_pair(
        &self,
        catalog: &dyn KindCatalog,
        first: &str,
        second: &str,
        keep: &str,
        kind: &str,
    ) -> Result<PipelineSpec, ConfigError> {
        let stage_of = |end: &str| end.split('.').next().unwrap_or_default().to_string();
        let bad = |m: String| {
            ConfigError::new(&self.file, ConfigErrorKind::Link, m).stage(first.to_string())
        };
        let out_of_first = self.links.iter().filter(|l| stage_of(&l.from) == first);
        let into_second = self.links.iter().filter(|l| stage_of(&l.to) == second);
        if out_of_first.count() != 1
            || into_second.count() != 1
            || !self
                .links
                .iter()
                .any(|l| stage_of(&l.from) == first && stage_of(&l.to) == second)
        {
            return Err(bad(format!(
                "`{first}` must feed `{second}` alone, and `{second}` take only `{first}`, to be \
                 made one `{kind}` stage"
            )));
        }
        let specs = catalog.params(kind).ok_or_else(|| {
            ConfigError::new(&self.file, ConfigErrorKind::UnknownKind, "unknown kind")
                .stage(keep.to_string())
        })?;
        let mut values: Vec<(String, Value)> = Vec::new();
        for name in [first, second] {
            let Some(stage) = self.stages.iter().find(|s| s.name == name) else {
                return Err(bad(format!("no stage `{name}`")));
            };
            for (k, v) in stage.params.iter() {
                if specs.iter().any(|p| p.name == k) {
                    values.retain(|(key, _)| key != k);
                    let origin = stage.params.origin(k).map(str::to_string);
                    values.push((k.to_string(), raw(v, origin.as_ref())));
                }
            }
        }
        let params = check(&self.file, keep, kind, specs, &values)?;
        let gone = if keep == first { second } else { first };
        let mut spec = self.clone();
        spec.stages.retain(|s| s.name != gone);
        if let Some(s) = spec.stages.iter_mut().find(|s| s.name == keep) {
            s.kind = kind.to_string();
            s.params = params;
            s.inject = None;
        }
        spec.links
            .retain(|l| !(stage_of(&l.from) == first && stage_of(&l.to) == second));
        for l in &mut spec.links {
            for end in [&mut l.from, &mut l.to] {
                if stage_of(end) == gone {
                    *end = end.replacen(gone, keep, 1);
                }
            }
        }
        Ok(spec)
    }
}
