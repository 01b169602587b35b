//! Pipeline files: YAML → a typed, validated [`PipelineSpec`].
//!
//! A pipeline file is layered with the `config` crate: the built-in defaults
//! (`configs/default.yaml`), then the file itself, then `DUPLEX__…` environment variables, then
//! `--set key=value` overrides. Everything a user can get wrong is checked here, before anything
//! runs, and reported with the file, the stage and the key: unknown top-level keys, unknown stage
//! kinds, unknown or mistyped params, malformed links. The structural checks (types, dangling
//! links, cycles) belong to the runtime's graph builder.
//!
//! This layer runs nothing and knows no stage implementation: stage kinds are described to it
//! through the [`KindCatalog`] trait.

mod error;
pub mod params;
mod pipeline;

pub use error::{ConfigError, ConfigErrorKind};
pub use params::{ParamDefault, ParamSpec, ParamType, ParamValue, Params};
pub use pipeline::{
    load, KindCatalog, LinkSpec, LoadOptions, MetricsSettings, PipelineSpec, RuntimeSettings,
    StageSpec,
};

/// The built-in defaults every pipeline file is layered over (the text of `configs/default.yaml`).
pub const DEFAULTS_YAML: &str = include_str!("../../configs/default.yaml");
