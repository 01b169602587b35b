//! Typed stage params: a stage kind declares each param once, as a field of a struct with its
//! [`ParamSpec`] ([`stage_params!`]), and its builder gets that struct from the checked
//! [`Params`]: no read by name, no silent fallback. The declarations are the kind's `params`
//! (what the configuration layer checks a pipeline file against and `duplex stages` lists);
//! a field whose type does not take its declared value is refused at build time, naming the
//! param (a mistake of the stage's code, caught by the first test that builds it).
//!
//! Knows the configuration's checked values and the stages' build errors; nothing of the
//! stages themselves.

use std::path::PathBuf;

use crate::config::{ParamSpec, ParamValue, Params};

use super::BuildError;

/// A field type of a typed params struct: what it takes from a checked param's value (`None`:
/// the param is unset, which only an optional one may be).
pub(crate) trait FromParam: Sized {
    /// The value, or what was expected instead.
    fn from_param(v: Option<&ParamValue>) -> Result<Self, &'static str>;
}

/// Reads `spec`'s param from `p` as a `T`; a value of another type (or none, for a param
/// that is not optional) is refused naming the param.
///
/// # Errors
///
/// [`BuildError::invalid`] with the param's key.
pub(crate) fn take<T: FromParam>(p: &Params, spec: &ParamSpec) -> Result<T, BuildError> {
    T::from_param(p.get(spec.name)).map_err(|expected| {
        let got = p
            .get(spec.name)
            .map_or("nothing".to_string(), |v| format!("{v:?}"));
        BuildError::invalid(format!(
            "`{}`: {expected} expected, got {got} (the stage's declaration and its reader \
             disagree)",
            spec.name
        ))
        .key(spec.name)
    })
}

impl FromParam for bool {
    fn from_param(v: Option<&ParamValue>) -> Result<Self, &'static str> {
        match v {
            Some(ParamValue::Bool(b)) => Ok(*b),
            _ => Err("a boolean"),
        }
    }
}

impl FromParam for i64 {
    fn from_param(v: Option<&ParamValue>) -> Result<Self, &'static str> {
        match v {
            Some(ParamValue::Int(i)) => Ok(*i),
            Some(ParamValue::Float(x)) if x.fract() == 0.0 && x.abs() < 9e15 => Ok(*x as i64),
            _ => Err("an integer"),
        }
    }
}

/// Narrower integers: from an integer param whose declared range fits them.
macro_rules! narrower {
    ($($t:ty),*) => {$(
        impl FromParam for $t {
            fn from_param(v: Option<&ParamValue>) -> Result<Self, &'static str> {
                i64::from_param(v)
                    .ok()
                    .and_then(|i| <$t>::try_from(i).ok())
                    .ok_or(concat!("an integer that fits a ", stringify!($t)))
            }
        }
    )*};
}
narrower!(i32, u16, u32, u64, usize);

impl FromParam for f64 {
    fn from_param(v: Option<&ParamValue>) -> Result<Self, &'static str> {
        match v {
            Some(ParamValue::Float(x)) => Ok(*x),
            Some(ParamValue::Int(i)) => Ok(*i as f64),
            _ => Err("a number"),
        }
    }
}

impl FromParam for f32 {
    fn from_param(v: Option<&ParamValue>) -> Result<Self, &'static str> {
        f64::from_param(v).map(|x| x as f32)
    }
}

impl FromParam for String {
    fn from_param(v: Option<&ParamValue>) -> Result<Self, &'static str> {
        match v {
            Some(ParamValue::Str(s)) => Ok(s.clone()),
            _ => Err("a string"),
        }
    }
}

impl FromParam for PathBuf {
    fn from_param(v: Option<&ParamValue>) -> Result<Self, &'static str> {
        match v {
            Some(ParamValue::Str(s)) if !s.is_empty() => Ok(PathBuf::from(s)),
            _ => Err("a path"),
        }
    }
}

impl FromParam for Vec<i64> {
    fn from_param(v: Option<&ParamValue>) -> Result<Self, &'static str> {
        match v {
            Some(ParamValue::IntList(l)) => Ok(l.clone()),
            _ => Err("a list of integers"),
        }
    }
}

/// An optional param: unset (or, for strings and paths, empty) is `None`.
impl<T: FromParam> FromParam for Option<T> {
    fn from_param(v: Option<&ParamValue>) -> Result<Self, &'static str> {
        match v {
            None => Ok(None),
            Some(ParamValue::Str(s)) if s.is_empty() => Ok(None),
            some => T::from_param(some).map(Some),
        }
    }
}

/// Declares a stage kind's params once: a struct with one field per param, each with its
/// [`ParamSpec`]; `SPECS` (the kind's `params`) lists them in order, and `from_params` reads
/// them from the checked [`Params`] ([`take`]).
///
/// ```ignore
/// stage_params! {
///     /// `resample`'s params.
///     struct ResampleParams {
///         to: u32 = ParamSpec { name: "to", ty: T::Int { min: 1000, max: 768_000 },
///                               default: D::Int(24_000), doc: "output rate, Hz" },
///     }
/// }
/// ```
macro_rules! stage_params {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $( $field:ident : $ty:ty = $spec:expr ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone)]
        $vis struct $name {
            $( pub(crate) $field: $ty, )*
        }

        impl $name {
            /// The kind's params, declared once (its `StageKind::params`; a model kind's list
            /// is composed of several structs', which a test checks against them).
            #[cfg_attr(not(test), allow(dead_code))]
            pub(crate) const SPECS: &'static [$crate::config::ParamSpec] = &[$($spec),*];

            /// The params of one stage, from its checked values.
            ///
            /// # Errors
            ///
            /// A value the field's type does not take, naming the param.
            pub(crate) fn from_params(
                p: &$crate::config::Params,
            ) -> Result<Self, $crate::stages::BuildError> {
                Ok($name {
                    $( $field: $crate::stages::params::take(p, &$spec)?, )*
                })
            }
        }
    };
}
pub(crate) use stage_params;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ParamDefault as D, ParamType as T};

    stage_params! {
        /// A kind's params, for the test.
        struct Example {
            rate: u32 = ParamSpec {
                name: "rate",
                ty: T::Int { min: 0, max: 768_000 },
                default: D::Int(24_000),
                doc: "Hz",
            },
            gain: f64 = ParamSpec {
                name: "gain",
                ty: T::Float { min: 0.0, max: 2.0 },
                default: D::Float(1.0),
                doc: "times",
            },
            path: Option<PathBuf> = ParamSpec {
                name: "path",
                ty: T::Path,
                default: D::None,
                doc: "a file",
            },
        }
    }

    #[test]
    fn a_kind_declares_its_params_once_and_reads_them_typed() {
        assert_eq!(
            Example::SPECS.iter().map(|s| s.name).collect::<Vec<_>>(),
            ["rate", "gain", "path"]
        );
        let p = Params::from_pairs([
            ("rate", ParamValue::Int(16_000)),
            ("gain", ParamValue::Int(1)),
        ]);
        let e = Example::from_params(&p).unwrap();
        assert_eq!((e.rate, e.gain, e.path), (16_000, 1.0, None));
        let p = Params::from_pairs([
            ("rate", ParamValue::Int(16_000)),
            ("gain", ParamValue::Float(0.5)),
            ("path", ParamValue::Str("a.wav".into())),
        ]);
        assert_eq!(
            Example::from_params(&p).unwrap().path,
            Some(PathBuf::from("a.wav"))
        );
    }

    #[test]
    fn a_value_the_field_does_not_take_is_refused_naming_the_param_not_defaulted() {
        // A declared param with no value (a required one, unset) is not read as 0.
        let e =
            Example::from_params(&Params::from_pairs([("gain", ParamValue::Int(1))])).unwrap_err();
        assert_eq!(e.key, Some("rate"));
        assert!(e.message.contains("an integer that fits a u32"), "{e:?}");
        let e = Example::from_params(&Params::from_pairs([
            ("rate", ParamValue::Int(-1)),
            ("gain", ParamValue::Int(1)),
        ]))
        .unwrap_err();
        assert_eq!(e.key, Some("rate"));
        let e = Example::from_params(&Params::from_pairs([
            ("rate", ParamValue::Int(1)),
            ("gain", ParamValue::Str("loud".into())),
        ]))
        .unwrap_err();
        assert_eq!(e.key, Some("gain"));
        assert!(e.message.contains("a number expected"), "{e:?}");
    }
}
