//! The audio layer's error type.

use std::path::PathBuf;

/// What went wrong in an audio building block. Messages name the file (or the rates) involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AudioError {
    /// The file could not be opened, read or written.
    #[error("{}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error (part of the message, so not also a `source`: a chain printed with
        /// its causes would say it twice).
        error: std::io::Error,
    },
    /// The file is not a WAV file (or its header is damaged). Give a RIFF/WAVE file.
    #[error("{}: not a readable WAV file: {detail}", path.display())]
    NotWav {
        /// The file.
        path: PathBuf,
        /// What the parser found.
        detail: String,
    },
    /// The file is a WAV file without samples.
    #[error("{}: {detail}", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
        /// Zero bytes, or zero samples.
        detail: String,
    },
    /// The WAV header is valid but the sample format is not supported.
    #[error("{}: unsupported WAV format: {detail}", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// The format found.
        detail: String,
    },
    /// A readable WAV file that does not fit its use (a voice prompt too short of rate, or too
    /// long).
    #[error("{}: {detail}", path.display())]
    Unfit {
        /// The file.
        path: PathBuf,
        /// What is wrong for that use.
        detail: String,
    },
    /// Samples could not be read after the header: the file is cut short or damaged.
    #[error("{}: corrupt or truncated after {frames} sample frames: {detail}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Frames read successfully before the error.
        frames: u64,
        /// The parser's error.
        detail: String,
    },
    /// No audio device matches what was asked for. The message lists the devices there are.
    #[error("audio {direction} device {name:?}: {detail}")]
    NoDevice {
        /// `input` or `output`.
        direction: &'static str,
        /// The device asked for.
        name: String,
        /// Which devices exist.
        detail: String,
    },
    /// An audio device exists but cannot be opened or started (busy, the server restarting).
    #[error("audio {direction} device {name:?}: {detail}")]
    Device {
        /// `input` or `output`.
        direction: &'static str,
        /// The device asked for.
        name: String,
        /// What went wrong (and which devices exist).
        detail: String,
    },
    /// The Opus encoder or the Ogg writer refused (a bitrate libopus does not take, a packet
    /// it cannot write).
    #[error("{what}: {detail}")]
    Codec {
        /// What refused: `libopus encoder`, `libopus bitrate 3`, `Ogg page`.
        what: String,
        /// Its message.
        detail: String,
    },
    /// A resampler could not be built for these rates.
    #[error("cannot resample {from} Hz to {to} Hz: {detail}")]
    Resample {
        /// Input rate.
        from: u32,
        /// Output rate.
        to: u32,
        /// Why.
        detail: String,
    },
}
