//! The frame types stages exchange, registered with the runtime.

pub use crate::audio::Pcm;
use crate::runtime::FrameData;

impl FrameData for Pcm {
    const NAME: &'static str = "Pcm";
}
