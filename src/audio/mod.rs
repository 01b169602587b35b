//! Audio building blocks: PCM buffers, WAV files, resampling, framing, test signals.
//!
//! Plain single-threaded code with unit tests that need no sound card and no runtime. Nothing
//! here knows about stages, threads or channels; the `stages` layer adapts these blocks to the
//! runtime.

pub mod device;
pub mod echo;
mod error;
pub mod framer;
pub mod jitter;
pub mod live;
pub mod opus;
pub mod pcm;
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
