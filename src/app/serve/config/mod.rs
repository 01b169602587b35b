//! The server's configuration: where it is read from, what each key means, and how a client's
//! query parameters become overrides of its session's pipeline.
//!
//! Layers (each over the one before): `configs/serve.yaml` (built in), the user's file
//! (`--config`, `$XDG_CONFIG_HOME/duplex/serve.yaml`, `~/.config/duplex/serve.yaml`),
//! `DUPLEX__…` environment variables. Every value keeps its origin, so an error names the file
//! and key (or the variable) it came from: the keys are read through the configuration layer's
//! one typed reader ([`Fields`]), the `ort:` section (the ONNX Runtime library) through its
//! shared reader ([`ort`](crate::config::ort)). A client's choices of its session are
//! [`query`]'s, the `webrtc:` section [`webrtc`]'s, the `sip:` section [`sip`]'s, `providers:`
//! [`providers`]'s, the `realtime:` section [`realtime`]'s. Knows nothing of
//! sockets.

mod edge;
mod providers;
mod query;
mod realtime;
mod sip;
mod webrtc;

use crate::files::FileError;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::fields::{ExecutionProvider, Fields};
use crate::config::{layers, ConfigError, ConfigErrorKind};

use providers::read_providers;
pub(crate) use query::shown;
pub use query::SessionParams;
use sip::read_sip;
use webrtc::read_webrtc;

/// The defaults (the text of `configs/serve.yaml`).
pub const DEFAULTS_YAML: &str = include_str!("../../../../configs/serve.yaml");
const DEFAULTS_ORIGIN: &str = "configs/serve.yaml (built in)";

const KEYS: &[&str] = &[
    "address",
    "allowed_hosts",
    "pipeline",
    "pack",
    "execution_provider",
    "max_sessions",
    "max_connections_per_ip",
    "voices",
    "text_prompt",
    "voice_prompt",
    "sampling",
    "limits",
    "drain_timeout_s",
    "prime_cache_mb",
    "prime_at_start",
    "prime_cache_file",
    "record",
    "log_transcripts",
    "keys_file",
    "allow_anonymous",
    "allowed_origins",
    "trusted_proxies",
    "forwarded_header",
    "protect_metrics",
    "instance_name",
    "twilio_auth_token",
    "twilio_url",
    "webrtc",
    "sip",
    "providers",
    "realtime",
    crate::config::ort::SECTION,
];
const RECORD_KEYS: &[&str] = &["dir", "max_file_kb", "max_total_mb"];
const LIMIT_KEYS: &[&str] = &[
    "max_message_bytes",
    "idle_timeout_s",
    "stall_timeout_s",
    "max_session_s",
    "handshake_timeout_s",
    "max_messages_per_s",
    "sessions_per_minute_per_ip",
    "session_burst_per_ip",
    "max_prompt_tokens",
    "max_voice_s",
    "max_steps",
];

pub use crate::config::sampling::Sampling;

/// Recording of sessions.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordSessions {
    /// Every session is recorded into a folder of its own under this one.
    pub dir: PathBuf,
    /// Rotation size of a session's timing files.
    pub max_file_bytes: u64,
    /// Recordings kept under `dir` at most; the oldest are deleted to make room.
    pub max_total_bytes: u64,
}

/// Per-session limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// The largest message a client may send.
    pub max_message_bytes: usize,
    /// Silence, then close, after the client has sent nothing this long.
    pub idle_timeout: Duration,
    /// Close a client that has not read for this long.
    pub stall_timeout: Duration,
    /// The longest session (`None`: no limit).
    pub max_session: Option<Duration>,
    /// The longest wait for the WebSocket upgrade.
    pub handshake_timeout: Duration,
    /// Messages (of any kind, pings included) a client may send per second, on average; twice
    /// that at once. A client over it is closed.
    pub max_messages_per_s: f64,
    /// New sessions one client address may open per minute, on average.
    pub sessions_per_minute_per_ip: f64,
    /// New sessions one client address may open at once, before the per-minute rate applies.
    pub session_burst_per_ip: f64,
    /// The longest persona a client may ask for, in tokens (a priming step each).
    pub max_prompt_tokens: usize,
    /// The longest voice prompt of the voices folder, seconds.
    pub max_voice_s: f64,
}

/// WebRTC (`webrtc:`).
#[derive(Debug, Clone, PartialEq)]
pub struct WebRtcSettings {
    /// The UDP address every peer's media shares.
    pub address: SocketAddr,
    /// Addresses announced as host candidates (`None` port: the UDP address's).
    pub public_addresses: Vec<(std::net::IpAddr, Option<u16>)>,
    /// STUN/TURN servers for the page: `(url, username, credential)`.
    pub ice_servers: Vec<(String, Option<(String, String)>)>,
    /// The jitter buffer's initial delay.
    pub jitter: Duration,
    /// The jitter buffer's largest delay.
    pub max_jitter: Duration,
    /// Where this replica's call resources are reached through a proxy: a path prefix
    /// (`/replica/a`) or an absolute URL (`https://a.example.com`) the `Location` of an answer
    /// starts with (empty: `/api/webrtc/TOKEN` as it is).
    pub location_base: String,
}

impl WebRtcSettings {
    /// The path under which this replica also answers its call resources
    /// (`PATH/api/webrtc/TOKEN`), so that a proxy routing the prefix to it need not strip it:
    /// `location_base`'s path, `None` when it has none.
    pub fn location_path(&self) -> Option<&str> {
        Some(webrtc::path_of(&self.location_base)).filter(|p| !p.is_empty())
    }
}

/// The providers' media streams' secrets (`providers:`); `None`: not checked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Providers {
    /// Telnyx's `stream_auth_token`: the `x-telnyx-streaming-auth-token` header must be it.
    pub telnyx_stream_token: Option<String>,
    /// Plivo's auth token: `X-Plivo-Signature-V3` is checked.
    pub plivo_auth_token: Option<String>,
    /// The stream's URL as Plivo was given it (what it signs); `None`: `wss://`, the `Host`,
    /// the path and query.
    pub plivo_url: Option<String>,
    /// Vonage's signature secret: the `Authorization: Bearer` JWT is checked.
    pub vonage_signature_secret: Option<String>,
    /// Exotel's `KEY:TOKEN`: HTTP Basic is checked.
    pub exotel_credentials: Option<String>,
}

/// Phone calls over SIP (`sip:`).
#[derive(Debug, Clone, PartialEq)]
pub struct SipSettings {
    /// Where SIP listens (UDP, and TCP on the same port when `tcp`).
    pub address: SocketAddr,
    /// Whether SIP is taken over TCP too.
    pub tcp: bool,
    /// The address announced in the SDP and the Contact (behind NAT); `None`: the address the
    /// call arrived at.
    pub public_address: Option<std::net::IpAddr>,
    /// RTP's ports (`None`: any the system gives).
    pub rtp_ports: Option<(u16, u16)>,
    /// Callers' addresses that may call (empty: any).
    pub allow: Vec<super::access::Cidr>,
    /// The user name and password callers must answer a Digest challenge with.
    pub digest: Option<(String, String)>,
    /// The Digest realm.
    pub realm: String,
    /// How long a call rings before it is answered.
    pub ring: Duration,
    /// A caller whose RTP stops for this long is hung up on.
    pub rtp_timeout: Duration,
    /// The jitter buffer's initial delay.
    pub jitter: Duration,
    /// The jitter buffer's largest delay.
    pub max_jitter: Duration,
    /// TCP connections SIP holds, per address and in all.
    pub(crate) tcp_limits: crate::app::serve::sip::StreamLimits,
    /// The longest session-timer interval (RFC 4028) a call is given; a caller asking for
    /// more gets this.
    pub session_expires: Duration,
    /// The smallest interval taken (`422` below it, with this as `Min-SE`).
    pub min_se: Duration,
}

impl SipSettings {
    /// The session timer's limits.
    pub(crate) fn timer_limits(&self) -> crate::app::serve::sip::timers::Limits {
        crate::app::serve::sip::timers::Limits {
            max: self.session_expires,
            min_se: self.min_se,
        }
    }
}

/// A checked server configuration.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The user's file (`defaults` when there is none).
    pub file: String,
    /// Listen address.
    pub address: SocketAddr,
    /// Host names (the `Host` header) the server answers to besides IP addresses and
    /// `localhost`: a name it does not know is refused (DNS rebinding).
    pub allowed_hosts: Vec<String>,
    /// Whether the agent's transcripts are logged (at INFO, escaped).
    pub log_transcripts: bool,
    /// Browser origins that may open sessions besides the server's own and loopback pages.
    pub allowed_origins: Vec<String>,
    /// Reverse proxies whose forwarded-address header is believed.
    pub trusted_proxies: Vec<super::access::Cidr>,
    /// The header they write the client's address in.
    pub forwarded_header: super::access::ForwardedHeader,
    /// The API keys (none: the server is open).
    pub keys: std::sync::Arc<super::access::Keys>,
    /// Serve other machines without keys, said explicitly.
    pub allow_anonymous: bool,
    /// `/metrics` needs a key too (when keys are configured).
    pub protect_metrics: bool,
    /// The name the server gives itself in its metadata (`instance_name`).
    pub instance_name: String,
    /// WebRTC (`None`: `webrtc.enabled: false`).
    pub webrtc: Option<WebRtcSettings>,
    /// Phone calls over SIP (`None`: `sip.enabled: false`).
    pub sip: Option<SipSettings>,
    /// The providers' media streams' secrets.
    pub providers: Providers,
    /// What `/v1/realtime` adds: the voice-activity detector, OpenAI's voice names.
    pub realtime: RealtimeSettings,
    /// Twilio's auth token: `/twilio/media` then needs Twilio's signature.
    pub twilio_auth_token: Option<String>,
    /// The stream's URL as the TwiML gives it to Twilio (what Twilio signs); `None`: `wss://`,
    /// the request's `Host` and path.
    pub twilio_url: Option<String>,
    /// The session template.
    pub pipeline: PathBuf,
    /// The pack of every model stage (`None`: the template's).
    pub pack: Option<String>,
    /// Where every model stage runs (`None`: the template's).
    pub execution_provider: Option<ExecutionProvider>,
    /// Sessions at once.
    pub max_sessions: usize,
    /// Connections per IP address at once.
    pub max_connections_per_ip: usize,
    /// Folder of voice prompts.
    pub voices: Option<PathBuf>,
    /// Default persona text.
    pub text_prompt: String,
    /// Default voice prompt (a file name in `voices`).
    pub voice_prompt: String,
    /// Default sampling.
    pub sampling: Sampling,
    /// Steps after which a conversation ends (0: none): `limits.max_steps`.
    pub max_steps: i64,
    /// Limits.
    pub limits: Limits,
    /// How long live sessions may run after SIGTERM.
    pub drain_timeout: Duration,
    /// Bytes of primed conversation states the process keeps (`prime_cache_mb`).
    pub prime_cache_bytes: usize,
    /// Prime the default session's state before serving (`prime_at_start`).
    pub prime_at_start: bool,
    /// Primed states loaded at start and saved at exit (`prime_cache_file`).
    pub prime_cache_file: Option<PathBuf>,
    /// Session recording (`None`: off).
    pub record: Option<RecordSessions>,
    /// The ONNX Runtime library `ort.library` chooses (`None`: the template's, else the
    /// search of [`ortlib`](crate::model::ortlib)).
    pub ort_library: Option<crate::config::OrtChoice>,
    origins: HashMap<String, String>,
}

/// The `realtime:` section.
#[derive(Debug, Clone, Default)]
pub struct RealtimeSettings {
    /// Silero VAD's ONNX model (`None`: no detector).
    pub vad_model: Option<PathBuf>,
    /// The user named the model: a server that cannot open it does not start (the built-in
    /// default's absence only leaves the detector off, said at start).
    pub vad_required: bool,
    /// A voice name a client may send (OpenAI's `marin`, `alloy` …) → a voice prompt of
    /// `voices`.
    pub voices: Vec<(String, String)>,
}

fn seconds(x: f64) -> Duration {
    Duration::from_secs_f64(x)
}

/// A number that counts something (sessions, bytes, MiB, tokens): a whole one within range.
fn whole(f: &Fields<'_>, k: &str, min: f64, max: f64) -> Result<f64, ConfigError> {
    let x = f.number(k, min, max)?;
    if x.fract() != 0.0 {
        return Err(f.err(
            ConfigErrorKind::WrongType,
            k,
            format!("expected a whole number, got {x}"),
        ));
    }
    Ok(x)
}

/// The `limits:` section, and its `max_steps`.
fn read_limits(l: &Fields<'_>) -> Result<(Limits, i64), ConfigError> {
    l.known(LIMIT_KEYS)?;
    let max_steps = whole(l, "max_steps", 0.0, 1e9)? as i64;
    let max_session = l.number("max_session_s", 0.0, 1e7)?;
    let limits = Limits {
        max_message_bytes: whole(l, "max_message_bytes", 1024.0, 1e9)? as usize,
        idle_timeout: seconds(l.number("idle_timeout_s", 0.1, 1e6)?),
        stall_timeout: seconds(l.number("stall_timeout_s", 0.1, 1e6)?),
        max_session: (max_session > 0.0).then(|| seconds(max_session)),
        handshake_timeout: seconds(l.number("handshake_timeout_s", 0.1, 1e6)?),
        max_messages_per_s: l.number("max_messages_per_s", 1.0, 1e6)?,
        sessions_per_minute_per_ip: l.number("sessions_per_minute_per_ip", 0.1, 1e6)?,
        session_burst_per_ip: l.number("session_burst_per_ip", 1.0, 1e6)?,
        max_prompt_tokens: whole(l, "max_prompt_tokens", 1.0, 100_000.0)? as usize,
        max_voice_s: l.number("max_voice_s", 0.08, 3600.0)?,
    };
    Ok((limits, max_steps))
}

/// The `record:` section (its folder made when given).
fn read_record(r: &Fields<'_>) -> Result<Option<RecordSessions>, ConfigError> {
    r.known(RECORD_KEYS)?;
    let record = match r.string("dir")?.trim() {
        "" => None,
        d => Some(RecordSessions {
            dir: PathBuf::from(d),
            max_file_bytes: (r.number("max_file_kb", 4.0, 1e9)? * 1024.0) as u64,
            max_total_bytes: (r.number("max_total_mb", 1.0, 1e9)? * 1024.0 * 1024.0) as u64,
        }),
    };
    if let Some(rec) = &record {
        std::fs::create_dir_all(&rec.dir).map_err(|e| {
            r.err(
                ConfigErrorKind::Read,
                "dir",
                format!("{}: {e}", rec.dir.display()),
            )
        })?;
    }
    Ok(record)
}

/// The primed-state file as the server will read it at start and write it at exit: a regular
/// file when it exists (a FIFO or a device would hang the start or take the states), in a
/// folder that exists (else the states would be lost at exit).
fn check_prime_cache_file(p: &Path) -> Result<PathBuf, FileError> {
    match std::fs::metadata(p) {
        Ok(m) if m.is_file() => {}
        Ok(_) => {
            return Err(FileError::new(
                p.display(),
                "not a regular file (a file `duplex prime --out` wrote, or none yet)",
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(FileError::new(p.display(), e)),
    }
    let folder = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !folder.is_dir() {
        return Err(FileError::new(
            p.display(),
            format!(
                "the folder {} does not exist (the primed states are written there at exit)",
                folder.display()
            ),
        ));
    }
    Ok(p.to_path_buf())
}

/// Loads and checks the server's configuration, and loads the ONNX Runtime library its
/// `ort.library` chooses, if any (before the session template's models look for one).
///
/// # Errors
///
/// A [`ConfigError`] naming the file (or the environment variable) and the key.
pub fn load(
    explicit: Option<&Path>,
    env: Option<HashMap<String, String>>,
) -> Result<ServeConfig, ConfigError> {
    let (fname, root) = layers::layered(
        DEFAULTS_YAML,
        DEFAULTS_ORIGIN,
        explicit,
        "serve.yaml",
        env.as_ref(),
    )?;
    let f = Fields::new(&fname, DEFAULTS_ORIGIN, &root);
    f.known(KEYS)?;
    let origins: HashMap<String, String> = f.origins().into_iter().collect();
    let ort_library = crate::config::ort::read(&f)?;
    let address: SocketAddr = f.address("address", "127.0.0.1:8998")?.ok_or_else(|| {
        f.err(
            ConfigErrorKind::Missing,
            "address",
            "the address to listen on, like 127.0.0.1:8998",
        )
    })?;
    let pipeline = PathBuf::from(f.string("pipeline")?);
    if let Err(e) = crate::files::check_regular(&pipeline) {
        return Err(f.err(
            ConfigErrorKind::Read,
            "pipeline",
            format!("session template {}: {e}", pipeline.display()),
        ));
    }
    let voices = match f.string("voices")?.trim() {
        "" => None,
        v => {
            let p = PathBuf::from(v);
            if !p.is_dir() {
                return Err(f.err(
                    ConfigErrorKind::Read,
                    "voices",
                    format!("{}: not a folder", p.display()),
                ));
            }
            Some(p)
        }
    };
    let voice_prompt = f.string("voice_prompt")?;
    // The depformer's params of the same names; `seed: -1` is a fresh seed per session.
    let sampling = Sampling::read(
        &f.table("sampling")?,
        &crate::stages::Registry::builtin(),
        true,
    )?;
    let (limits, max_steps) = read_limits(&f.table("limits")?)?;
    let record = read_record(&f.table("record")?)?;
    let execution_provider = f.provider("execution_provider")?;
    let edge = edge::read(&f, env.as_ref(), address)?;
    let log_transcripts = f.boolean("log_transcripts")?;
    let instance_name = match f.string("instance_name")?.trim() {
        "" => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "duplex".into()),
        n => n.to_string(),
    };
    let webrtc = read_webrtc(&f.table("webrtc")?, address)?;
    let sip = read_sip(&f.table("sip")?, edge.keys.any())?;
    let providers = read_providers(&f.table("providers")?)?;
    let rt = f.table("realtime")?;
    let realtime = realtime::read_realtime(&rt)?;
    let config = ServeConfig {
        webrtc,
        sip,
        providers,
        realtime,
        twilio_auth_token: edge.twilio_auth_token,
        twilio_url: edge.twilio_url,
        allowed_hosts: edge.allowed_hosts,
        allowed_origins: edge.allowed_origins,
        trusted_proxies: edge.trusted_proxies,
        forwarded_header: edge.forwarded_header,
        keys: std::sync::Arc::new(edge.keys),
        allow_anonymous: edge.allow_anonymous,
        protect_metrics: edge.protect_metrics,
        instance_name,
        log_transcripts,
        execution_provider,
        record,
        address,
        pipeline,
        pack: Some(f.string("pack")?).filter(|p| !p.trim().is_empty()),
        max_sessions: whole(&f, "max_sessions", 1.0, 100_000.0)? as usize,
        max_connections_per_ip: whole(&f, "max_connections_per_ip", 1.0, 1e6)? as usize,
        voices,
        text_prompt: f.string("text_prompt")?,
        voice_prompt: voice_prompt.clone(),
        sampling,
        max_steps,
        limits,
        drain_timeout: seconds(f.number("drain_timeout_s", 0.0, 1e6)?),
        prime_cache_bytes: (whole(&f, "prime_cache_mb", 0.0, 1e6)? * 1048576.0) as usize,
        prime_at_start: f.boolean("prime_at_start")?,
        prime_cache_file: match Some(f.string("prime_cache_file")?)
            .filter(|p| !p.trim().is_empty())
            .map(PathBuf::from)
        {
            Some(p) => Some(
                check_prime_cache_file(&p)
                    .map_err(|e| f.err(ConfigErrorKind::Read, "prime_cache_file", e.to_string()))?,
            ),
            None => None,
        },
        file: fname.clone(),
        ort_library,
        origins,
    };
    if !voice_prompt.trim().is_empty() {
        config
            .voice_path(&voice_prompt)
            .map_err(|m| f.err(ConfigErrorKind::Read, "voice_prompt", m))?;
    }
    realtime::check_voices(&rt, &config)?;
    // The library the settings choose is loaded now, before the session template (whose models
    // would otherwise find one of their own): a template's own `ort.library` must then name
    // the same one (one library per process).
    if let Some(chosen) = &config.ort_library {
        crate::app::load_chosen_ort(chosen)?;
    }
    Ok(config)
}

impl ServeConfig {
    /// Where `key`'s value came from, in words.
    pub fn origin(&self, key: &str) -> String {
        self.origins
            .get(key)
            .cloned()
            .unwrap_or_else(|| format!("{}: `{key}`", self.file))
    }

    /// A voice prompt's file: a plain file name inside the voices folder (no path, no `..`, no
    /// link leading outside it), a WAV that passes the voice check from its header alone (rate,
    /// length: nothing is decoded).
    ///
    /// # Errors
    ///
    /// A message for the client, naming the voice and not the server's folders.
    pub fn voice_path(&self, name: &str) -> Result<PathBuf, String> {
        let Some(dir) = &self.voices else {
            return Err(format!(
                "voice prompt {}: this server has no voices folder",
                shown(name)
            ));
        };
        let plain = !name.is_empty()
            && name.len() <= 255
            && !name.contains(['/', '\\', '\0'])
            && name != "."
            && name != "..";
        if !plain {
            return Err(format!(
                "voice prompt {}: a file name of the voices folder is expected",
                shown(name)
            ));
        }
        let unknown = || format!("voice prompt {}: no such voice on this server", shown(name));
        let p = dir.join(name);
        // A link may point inside the folder (an alias), never out of it.
        let (Ok(real), Ok(real_dir)) = (p.canonicalize(), dir.canonicalize()) else {
            return Err(unknown());
        };
        if !real.starts_with(&real_dir) {
            tracing::warn!(
                voice = %p.display(),
                target = %real.display(),
                "a voice prompt links outside the voices folder: refused"
            );
            return Err(unknown());
        }
        crate::files::check_regular(&real).map_err(|_| unknown())?;
        crate::stages::check_voice(&real, self.limits.max_voice_s).map_err(|e| {
            tracing::warn!("voice prompt refused: {e}");
            format!(
                "voice prompt {}: not a usable voice (a WAV of 8 kHz or more, at most {} s)",
                shown(name),
                self.limits.max_voice_s
            )
        })?;
        Ok(p)
    }

    /// The voices a client may name: the WAV files of the voices folder that pass
    /// [`voice_path`](Self::voice_path), sorted. Each refused file is logged once, here.
    pub fn usable_voices(&self) -> Vec<String> {
        let Some(dir) = &self.voices else {
            return Vec::new();
        };
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| n.to_ascii_lowercase().ends_with(".wav"))
            .filter(|n| self.voice_path(n).is_ok())
            .collect();
        names.sort();
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Option<HashMap<String, String>> {
        Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    fn defaults() -> ServeConfig {
        // The tests run in the crate root, where the default template is.
        load(None, env(&[])).unwrap()
    }

    #[test]
    fn the_environment_overrides_the_defaults_and_bad_values_name_the_variable() {
        let c = load(
            None,
            env(&[
                ("DUPLEX__MAX_SESSIONS", "9"),
                ("DUPLEX__LIMITS__IDLE_TIMEOUT_S", "2.5"),
            ]),
        )
        .unwrap();
        assert_eq!(c.max_sessions, 9);
        assert_eq!(c.limits.idle_timeout, Duration::from_millis(2500));
        let e = load(None, env(&[("DUPLEX__MAX_SESSIONS", "0")])).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("DUPLEX__MAX_SESSIONS") && m.contains("out of range"),
            "{m}"
        );
        let e = load(None, env(&[("DUPLEX__LIMITS__IDEL_TIMEOUT_S", "3")])).unwrap_err();
        assert!(e.to_string().contains("idle_timeout_s"), "{e}");
    }

    #[test]
    fn query_parameters_override_the_defaults_and_bad_ones_are_named() {
        let c = defaults();
        let q = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<Vec<_>>()
        };
        let p = c
            .session_params(&q(&[
                ("text_temperature", "0.2"),
                ("text_seed", "5"),
                ("audio_seed", "9"),
                ("worker_auth_id", "x"),
                ("text_prompt", "<system> You are kind. <system>"),
            ]))
            .unwrap();
        assert_eq!(p.sampling.text_temperature, 0.2);
        assert_eq!(p.sampling.text_seed, Some(5));
        assert_eq!(p.sampling.audio_seed, Some(9));
        assert_eq!(p.text_prompt, "You are kind.");
        let e = c.session_params(&q(&[("audio_topk", "lots")])).unwrap_err();
        assert!(
            e.contains("audio_topk") && e.contains("not a number"),
            "{e}"
        );
        let e = c
            .session_params(&q(&[("voice_prompt", "../etc/passwd")]))
            .unwrap_err();
        assert!(e.contains("voice"), "{e}");
    }

    /// `execution_provider` moves every model stage of the template, blaming the key; a
    /// provider duplex does not have is refused naming it.
    #[test]
    fn execution_provider_moves_every_model_stage() {
        let c = load(None, env(&[("DUPLEX__EXECUTION_PROVIDER", "cuda")])).unwrap();
        let registry = crate::stages::Registry::builtin();
        let opts = crate::config::LoadOptions::default();
        let spec = crate::config::load(&c.pipeline, &opts, &registry).unwrap();
        let p = c.session_params(&[]).unwrap();
        let sets = c.session_overrides(&spec, &registry, &p);
        let moved: Vec<&str> = sets
            .iter()
            .filter(|o| o.param == "execution_provider")
            .inspect(|o| {
                assert_eq!(o.value, crate::config::ParamValue::Str("cuda".into()));
                assert_eq!(o.origin, "environment variable DUPLEX__EXECUTION_PROVIDER");
            })
            .map(|o| o.stage.as_str())
            .collect();
        assert_eq!(moved.len(), 4, "{moved:?}");
        assert!(defaults().execution_provider.is_none());
        let e = load(None, env(&[("DUPLEX__EXECUTION_PROVIDER", "tpu")])).unwrap_err();
        assert!(
            e.to_string().contains("\"tpu\" is not one of cpu, cuda"),
            "{e}"
        );
    }
}
