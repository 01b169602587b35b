//! Pipeline files: YAML → a typed, validated [`PipelineSpec`].
//!
//! A pipeline file is layered ([`layers`]): the built-in defaults (`configs/default.yaml`),
//! then the file itself, then `DUPLEX__…` environment variables, then `--set key=value`
//! overrides; every value remembers its layer, so errors blame the right one. Files are read
//! at a bounded cost ([`yaml`]): size, nesting and alias expansion are limited before and while
//! they are parsed. Everything a user can get wrong is checked here, before anything
//! runs, and reported with the file, the stage and the key: unknown top-level keys, unknown stage
//! kinds, unknown or mistyped params, malformed links. The structural checks (types, dangling
//! links, cycles) belong to the runtime's graph builder.
//!
//! The applications' own settings (the daemon's, the server's) are layered the same way and
//! read through the same typed reader ([`fields`]), so that every error names the file or the
//! variable and the key alike; the `ort:` section that chooses the ONNX Runtime library is one
//! reader shared by all of them ([`ort`]).
//!
//! This layer runs nothing and knows no stage implementation: stage kinds are described to it
//! through the [`KindCatalog`] trait.

mod error;
pub mod fields;
pub mod layers;
pub mod ort;
mod overrides;
pub mod params;
mod paths;
mod pipeline;
pub mod sampling;
pub use crate::yaml;

pub use error::{ConfigError, ConfigErrorKind};
pub use layers::Override;
pub use ort::OrtChoice;
pub use overrides::ParamOverride;
pub use params::{ParamDefault, ParamSpec, ParamType, ParamValue, Params};
pub use pipeline::{
    load, KindCatalog, LinkSpec, LoadOptions, MetricsSettings, PipelineSpec, RecordSettings,
    RuntimeSettings, StageSpec, INJECT_KEY, TOP_KEYS as PIPELINE_KEYS,
};

/// The built-in defaults every pipeline file is layered over (the text of `configs/default.yaml`).
pub const DEFAULTS_YAML: &str = include_str!("../../configs/default.yaml");

/// The origin of the built-in defaults in messages.
pub const DEFAULTS_ORIGIN: &str = "configs/default.yaml (built in)";
