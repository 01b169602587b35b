//! WAV files in and out, as mono `f32`.
//!
//! [`WavReader`] streams any PCM WAV hound understands (8/16/24/32-bit integer, 32-bit float; any
//! rate; any channel count, down-mixed to mono by averaging). [`WavWriter`] writes 16-bit integer
//! or 32-bit float and rewrites the header on every [`flush`](WavWriter::flush), so a process
//! killed mid-run leaves a valid file holding everything up to the last flush.

use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::{Path, PathBuf};

use super::AudioError;

/// A streaming WAV reader producing mono `f32` samples.
pub struct WavReader {
    path: PathBuf,
    reader: hound::WavReader<BufReader<File>>,
    channels: usize,
    int_scale: Option<f32>,
    frames_total: u64,
    frames_read: u64,
    /// Size of the file: what a header may claim is bounded by what the file can hold.
    file_bytes: u64,
    /// An error met after samples were read: reported by the next call, so that every sample
    /// read before it is handed out first.
    pending: Option<AudioError>,
    scratch_i: Vec<i32>,
    scratch_f: Vec<f32>,
}

fn not_wav(path: &Path, e: hound::Error) -> AudioError {
    match e {
        hound::Error::IoError(error) if error.kind() != std::io::ErrorKind::UnexpectedEof => {
            AudioError::Io {
                path: path.into(),
                error,
            }
        }
        hound::Error::IoError(_) => AudioError::NotWav {
            path: path.into(),
            detail: "the header is cut short".into(),
        },
        hound::Error::Unsupported => AudioError::Unsupported {
            path: path.into(),
            detail: "hound cannot decode this encoding (use PCM integer or 32-bit float)".into(),
        },
        e => AudioError::NotWav {
            path: path.into(),
            detail: e.to_string(),
        },
    }
}

impl WavReader {
    /// Opens `path` and reads its header.
    ///
    /// # Errors
    ///
    /// [`AudioError::Io`] when it cannot be opened, [`AudioError::Empty`] for a 0-byte file or a
    /// WAV without samples, [`AudioError::NotWav`] when it is not a WAV file,
    /// [`AudioError::Unsupported`] for an encoding other than PCM integer or 32-bit float.
    pub fn open(path: &Path) -> Result<Self, AudioError> {
        // Not a plain open: a FIFO would block until some writer appeared.
        let file = crate::files::open_regular(path).map_err(|error| AudioError::Io {
            path: path.into(),
            error,
        })?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if len == 0 {
            return Err(AudioError::Empty {
                path: path.into(),
                detail: "the file is empty (0 bytes)".into(),
            });
        }
        let reader = hound::WavReader::new(BufReader::new(file)).map_err(|e| not_wav(path, e))?;
        let spec = reader.spec();
        let int_scale = match spec.sample_format {
            hound::SampleFormat::Int => {
                if !(1..=32).contains(&spec.bits_per_sample) {
                    return Err(AudioError::Unsupported {
                        path: path.into(),
                        detail: format!("{}-bit integer samples", spec.bits_per_sample),
                    });
                }
                Some(1.0 / (1u64 << (spec.bits_per_sample - 1)) as f32)
            }
            hound::SampleFormat::Float => {
                if spec.bits_per_sample != 32 {
                    return Err(AudioError::Unsupported {
                        path: path.into(),
                        detail: format!("{}-bit float samples", spec.bits_per_sample),
                    });
                }
                None
            }
        };
        if spec.channels == 0 || spec.sample_rate == 0 {
            return Err(AudioError::NotWav {
                path: path.into(),
                detail: format!(
                    "header declares {} channels at {} Hz",
                    spec.channels, spec.sample_rate
                ),
            });
        }
        let frames_total = reader.duration() as u64;
        if frames_total == 0 {
            return Err(AudioError::Empty {
                path: path.into(),
                detail: "the WAV file has no samples".into(),
            });
        }
        Ok(WavReader {
            path: path.into(),
            channels: spec.channels as usize,
            int_scale,
            frames_total,
            frames_read: 0,
            file_bytes: len,
            pending: None,
            reader,
            scratch_i: Vec::new(),
            scratch_f: Vec::new(),
        })
    }

    /// Sample rate in Hz.
    pub fn rate(&self) -> u32 {
        self.reader.spec().sample_rate
    }

    /// Channels in the file (the output is always mono).
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Bits per sample and whether they are float, as in the header.
    pub fn format(&self) -> (u16, bool) {
        let s = self.reader.spec();
        (
            s.bits_per_sample,
            s.sample_format == hound::SampleFormat::Float,
        )
    }

    /// Sample frames (per channel) declared by the header.
    pub fn frames(&self) -> u64 {
        self.frames_total
    }

    /// Sample frames read so far.
    pub fn position(&self) -> u64 {
        self.frames_read
    }

    /// Reads up to `max_frames` frames, down-mixed to mono, appended to `out`. Returns the number
    /// of frames read: 0 at the end of the file.
    ///
    /// When the data ends early or cannot be decoded, the frames read before the fault are
    /// returned first and the error comes with the next call, so nothing readable is lost.
    ///
    /// # Errors
    ///
    /// [`AudioError::Corrupt`] when the data ends before the header says, cannot be decoded, or
    /// holds a sample that is not a finite number (NaN, infinity).
    pub fn read(&mut self, max_frames: usize, out: &mut Vec<f32>) -> Result<usize, AudioError> {
        if let Some(e) = self.pending.take() {
            return Err(e);
        }
        let want = (max_frames as u64).min(self.frames_total - self.frames_read) as usize;
        if want == 0 {
            return Ok(0);
        }
        let n = want * self.channels;
        let start = out.len();
        let ch = self.channels;
        let mut fault = None;
        match self.int_scale {
            Some(scale) => {
                self.scratch_i.clear();
                for s in self.reader.samples::<i32>().take(n) {
                    match s {
                        Ok(v) => self.scratch_i.push(v),
                        Err(e) => {
                            fault = Some(e.to_string());
                            break;
                        }
                    }
                }
                let k = scale / ch as f32;
                out.extend(self.scratch_i.chunks_exact(ch).map(|fr| {
                    if ch == 1 {
                        fr[0] as f32 * scale
                    } else {
                        fr.iter().map(|&v| v as f32).sum::<f32>() * k
                    }
                }));
            }
            None => {
                self.scratch_f.clear();
                for s in self.reader.samples::<f32>().take(n) {
                    match s {
                        Ok(v) if v.is_finite() => self.scratch_f.push(v),
                        // No resampler, codec or model makes sense of these: the file is refused
                        // here, naming where, the frames before kept.
                        Ok(_) => {
                            let at = self.frames_read * ch as u64 + self.scratch_f.len() as u64;
                            fault = Some(format!(
                                "sample {at} is not a finite number (NaN or infinity)"
                            ));
                            break;
                        }
                        Err(e) => {
                            fault = Some(e.to_string());
                            break;
                        }
                    }
                }
                out.extend(
                    self.scratch_f
                        .chunks_exact(ch)
                        .map(|fr| fr.iter().sum::<f32>() / ch as f32),
                );
            }
        }
        let got = out.len() - start;
        self.frames_read += got as u64;
        let error = match fault {
            Some(detail) => Some(AudioError::Corrupt {
                path: self.path.clone(),
                frames: self.frames_read,
                detail,
            }),
            None if got < want => Some(AudioError::Corrupt {
                path: self.path.clone(),
                frames: self.frames_read,
                detail: format!(
                    "the header declares {} frames but the data ends early",
                    self.frames_total
                ),
            }),
            None => None,
        };
        if let Some(e) = error {
            if got == 0 {
                return Err(e);
            }
            self.pending = Some(e);
        }
        Ok(got)
    }

    /// Reads the whole remaining file.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read).
    pub fn read_all(&mut self) -> Result<Vec<f32>, AudioError> {
        // The header's count, but no more than the file can hold: a damaged header may claim
        // billions of frames.
        let bytes_per_frame = (self.format().0 as u64).div_ceil(8).max(1) * self.channels as u64;
        let room = self.file_bytes / bytes_per_frame;
        let mut v = Vec::with_capacity((self.frames_total - self.frames_read).min(room) as usize);
        while self.read(1 << 16, &mut v)? > 0 {}
        Ok(v)
    }
}

/// Sample encoding of a written WAV file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WavFormat {
    /// 16-bit signed integer (clipped to [-1, 1)).
    #[default]
    I16,
    /// 32-bit IEEE float.
    F32,
}

impl WavFormat {
    /// Spellings accepted in pipeline files.
    pub const NAMES: [&'static str; 2] = ["i16", "f32"];

    /// Parses `i16` or `f32`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "i16" => Some(WavFormat::I16),
            "f32" => Some(WavFormat::F32),
            _ => None,
        }
    }
}

/// A mono WAV writer whose header is kept valid at every flush.
pub struct WavWriter {
    path: PathBuf,
    writer: Option<hound::WavWriter<BufWriter<File>>>,
    format: WavFormat,
    frames: u64,
}

impl WavWriter {
    /// Creates (or truncates) `path`, creating its parent directory if needed.
    ///
    /// # Errors
    ///
    /// [`AudioError::Io`] when the file cannot be created.
    pub fn create(path: &Path, rate: u32, format: WavFormat) -> Result<Self, AudioError> {
        let io = |error| AudioError::Io {
            path: path.into(),
            error,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let spec = hound::WavSpec {
            channels: 1,
            sample_rate: rate,
            bits_per_sample: match format {
                WavFormat::I16 => 16,
                WavFormat::F32 => 32,
            },
            sample_format: match format {
                WavFormat::I16 => hound::SampleFormat::Int,
                WavFormat::F32 => hound::SampleFormat::Float,
            },
        };
        let writer = hound::WavWriter::create(path, spec).map_err(|e| match e {
            hound::Error::IoError(source) => io(source),
            e => io(std::io::Error::other(e.to_string())),
        })?;
        Ok(WavWriter {
            path: path.into(),
            writer: Some(writer),
            format,
            frames: 0,
        })
    }

    fn err(&self, e: hound::Error) -> AudioError {
        AudioError::Io {
            path: self.path.clone(),
            error: match e {
                hound::Error::IoError(s) => s,
                e => std::io::Error::other(e.to_string()),
            },
        }
    }

    /// Appends samples. A 16-bit file stores `round(x · 32768)` clipped to the 16-bit range, so
    /// samples read from a 16-bit file are written back bit-exact.
    ///
    /// # Errors
    ///
    /// [`AudioError::Io`] on a write error.
    pub fn write(&mut self, samples: &[f32]) -> Result<(), AudioError> {
        let Some(w) = self.writer.as_mut() else {
            return Ok(());
        };
        let r = match self.format {
            WavFormat::I16 => samples.iter().try_for_each(|&x| {
                let v = (x * 32768.0).round().clamp(-32768.0, 32767.0) as i16;
                w.write_sample(v)
            }),
            WavFormat::F32 => samples.iter().try_for_each(|&x| w.write_sample(x)),
        };
        r.map_err(|e| self.err(e))?;
        self.frames += samples.len() as u64;
        Ok(())
    }

    /// Writes buffered samples and rewrites the header, so the file on disk is complete and
    /// valid up to here.
    ///
    /// # Errors
    ///
    /// [`AudioError::Io`] on a write error.
    pub fn flush(&mut self) -> Result<(), AudioError> {
        match self.writer.as_mut() {
            Some(w) => w.flush().map_err(|e| self.err(e)),
            None => Ok(()),
        }
    }

    /// Frames written so far.
    pub fn frames(&self) -> u64 {
        self.frames
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Flushes and closes the file. (Dropping a writer also closes it, ignoring errors.)
    ///
    /// # Errors
    ///
    /// [`AudioError::Io`] on a write error.
    pub fn finalize(mut self) -> Result<(), AudioError> {
        match self.writer.take() {
            Some(w) => w.finalize().map_err(|e| self.err(e)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn i16_round_trip_is_bit_exact() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("in.wav");
        let spec = hound::WavSpec {
            channels: 1,
            sample_rate: 16_000,
            bits_per_sample: 16,
            sample_format: hound::SampleFormat::Int,
        };
        let mut w = hound::WavWriter::create(&src, spec).unwrap();
        let values: Vec<i16> = (0..70_000i32)
            .map(|i| ((i * 7919) % 65536 - 32768) as i16)
            .collect();
        for &v in &values {
            w.write_sample(v).unwrap();
        }
        w.finalize().unwrap();

        let mut r = WavReader::open(&src).unwrap();
        let samples = r.read_all().unwrap();
        let dst = dir.path().join("out.wav");
        let mut out = WavWriter::create(&dst, r.rate(), WavFormat::I16).unwrap();
        out.write(&samples).unwrap();
        out.finalize().unwrap();
        let back: Vec<i16> = hound::WavReader::open(&dst)
            .unwrap()
            .samples::<i16>()
            .map(|s| s.unwrap())
            .collect();
        assert_eq!(back, values);
    }

    #[test]
    fn stereo_is_averaged_to_mono() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("st.wav");
        let spec = hound::WavSpec {
            channels: 2,
            sample_rate: 8000,
            bits_per_sample: 32,
            sample_format: hound::SampleFormat::Float,
        };
        let mut w = hound::WavWriter::create(&p, spec).unwrap();
        for i in 0..100 {
            w.write_sample(i as f32 / 100.0).unwrap();
            w.write_sample(-0.5f32).unwrap();
        }
        w.finalize().unwrap();
        let mut r = WavReader::open(&p).unwrap();
        assert_eq!((r.channels(), r.frames()), (2, 100));
        let v = r.read_all().unwrap();
        assert_eq!(v.len(), 100);
        assert!((v[10] - (0.1 - 0.5) / 2.0).abs() < 1e-6);
    }

    #[test]
    fn flushed_file_is_readable_before_finalize() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("live.wav");
        let mut w = WavWriter::create(&p, 24_000, WavFormat::F32).unwrap();
        w.write(&[0.25; 960]).unwrap();
        w.flush().unwrap();
        // Simulate a killed process: the writer is never finalized nor dropped.
        std::mem::forget(w);
        let mut r = WavReader::open(&p).unwrap();
        assert_eq!(r.frames(), 960);
        assert_eq!(r.read_all().unwrap(), vec![0.25; 960]);
    }

    #[test]
    fn bad_files_are_named_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.wav");
        std::fs::write(&empty, b"").unwrap();
        let text = dir.path().join("notes.wav");
        std::fs::write(&text, b"this is not a wav file at all, just some text").unwrap();
        let missing = dir.path().join("missing.wav");
        for (p, want) in [
            (&empty, "empty"),
            (&text, "not a readable WAV file"),
            (&missing, "No such file"),
        ] {
            let e = WavReader::open(p).err().unwrap().to_string();
            assert!(e.contains(p.to_str().unwrap()), "{e}");
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn truncated_data_is_reported_with_the_frame_count() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cut.wav");
        let mut w = WavWriter::create(&p, 8000, WavFormat::I16).unwrap();
        w.write(&[0.1; 1000]).unwrap();
        w.finalize().unwrap();
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 400]).unwrap();
        let mut r = WavReader::open(&p).unwrap();
        let e = r.read_all().unwrap_err().to_string();
        assert!(
            e.contains("cut.wav") && e.contains("truncated after 800"),
            "{e}"
        );
    }

    /// Regression: a file cut inside the first chunk wrote nothing, one cut inside a later
    /// chunk lost that chunk's samples.
    #[test]
    fn a_truncated_file_hands_out_every_sample_it_holds_before_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cut.wav");
        let mut w = WavWriter::create(&p, 48_000, WavFormat::I16).unwrap();
        let samples: Vec<f32> = (0..4800).map(|i| (i % 100) as f32 / 200.0).collect();
        w.write(&samples).unwrap();
        w.finalize().unwrap();
        let bytes = std::fs::read(&p).unwrap();
        for keep in [500usize, 1500] {
            std::fs::write(&p, &bytes[..44 + 2 * keep]).unwrap();
            let mut r = WavReader::open(&p).unwrap();
            let mut got = Vec::new();
            let e = loop {
                match r.read(960, &mut got) {
                    Ok(0) => panic!("the end of a truncated file is not an error"),
                    Ok(_) => {}
                    Err(e) => break e.to_string(),
                }
            };
            assert_eq!(got.len(), keep, "{e}");
            assert!((got[keep - 1] - samples[keep - 1]).abs() < 1e-4);
            assert!(e.contains(&format!("truncated after {keep}")), "{e}");
        }
    }

    #[test]
    fn a_float_wav_with_nan_or_infinity_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let p = dir.path().join("nan.wav");
            let spec = hound::WavSpec {
                channels: 2,
                sample_rate: 16_000,
                bits_per_sample: 32,
                sample_format: hound::SampleFormat::Float,
            };
            let mut w = hound::WavWriter::create(&p, spec).unwrap();
            for i in 0..1000 {
                w.write_sample(if i == 701 { bad } else { 0.25 }).unwrap();
            }
            w.finalize().unwrap();
            let mut r = WavReader::open(&p).unwrap();
            let mut got = Vec::new();
            let e = loop {
                match r.read(100, &mut got) {
                    Ok(0) => panic!("{bad} read as a sample"),
                    Ok(_) => {}
                    Err(e) => break e.to_string(),
                }
            };
            // The frames before the bad sample (its frame is the 351st) are handed out.
            assert_eq!(got.len(), 350, "{e}");
            assert!(got.iter().all(|v| v.is_finite()));
            assert!(
                e.contains("nan.wav") && e.contains("sample 701 is not a finite number"),
                "{e}"
            );
        }
    }

    /// A header claiming far more frames than the file holds does not make `read_all`
    /// allocate for them.
    #[test]
    fn a_lying_header_does_not_reserve_memory_for_frames_the_file_cannot_hold() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("liar.wav");
        let mut w = WavWriter::create(&p, 8000, WavFormat::F32).unwrap();
        w.write(&[0.5; 10]).unwrap();
        w.finalize().unwrap();
        let mut bytes = std::fs::read(&p).unwrap();
        // data chunk size: 2^31 bytes of samples
        let at = bytes.len() - 40 - 4;
        bytes[at..at + 4].copy_from_slice(&(1u32 << 31).to_le_bytes());
        std::fs::write(&p, &bytes).unwrap();
        let mut r = WavReader::open(&p).unwrap();
        assert!(r.frames() > 100_000_000);
        let e = r.read_all().unwrap_err().to_string();
        assert!(e.contains("truncated after 10"), "{e}");
    }
}
