//! Audio building blocks: PCM buffers, WAV files, G.711, resampling, framing, test signals, echo
//! cancellation; and the sound devices.
//!
//! Plain single-threaded code with unit tests that need no sound card and no runtime, except
//! the device modules (`device`, `live`, `reference`), which own the device threads and the
//! lock-free rings between their callbacks and the rest. Nothing here knows about stages; the
//! `stages` layer adapts these blocks to the runtime.

pub mod device;
pub mod echo;
mod error;
pub mod framer;
pub mod g711;
pub mod jitter;
pub mod live;
pub mod opus;
pub mod pace;
pub mod pcm;
pub mod phone;
pub mod reference;
pub mod resample;
pub mod synth;
pub mod wav;

pub use error::AudioError;
pub use framer::Framer;
pub use pcm::{Pcm, FRAME_SAMPLES, MODEL_RATE};
pub use resample::StreamResampler;
pub use synth::{Synth, Waveform};
pub use wav::{WavFormat, WavReader, WavWriter};
