//! Opening the files a user names, safely: regular files only, read at a bounded cost.
//!
//! A path in a configuration can name anything: a FIFO (opening it for reading blocks until
//! some writer appears, so a pipeline would hang with no message), a directory, a device, or a
//! file far larger than expected. [`open_regular`] opens without blocking and refuses anything
//! but a regular file, naming what it found; [`read_limited`] adds a size bound. Every layer
//! that reads a user's file goes through here, and a file's content found wrong is told as a
//! [`FileError`] (where, and what). Knows nothing of what the files hold.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// Why a file (or folder) could not be written or read back: where (the file, a folder, or a
/// file's line as `FILE:LINE`) and what was wrong there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{at}: {what}")]
pub struct FileError {
    /// The file, folder or `FILE:LINE` at fault.
    pub at: String,
    /// What was wrong there.
    pub what: String,
}

impl FileError {
    /// `what` was wrong at `at`.
    pub fn new(at: impl std::fmt::Display, what: impl std::fmt::Display) -> Self {
        FileError {
            at: at.to_string(),
            what: what.to_string(),
        }
    }
}

/// What a file that is not a regular file is, in words (`a FIFO (named pipe)`, …).
pub fn kind_of(ft: std::fs::FileType) -> &'static str {
    if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO (named pipe)"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        "a regular file"
    }
}

fn not_regular(ft: std::fs::FileType) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("is {}, not a regular file", kind_of(ft)),
    )
}

/// Opens `path` for reading if it is a regular file (following symbolic links).
///
/// The file is opened with `O_NONBLOCK`, so that naming a FIFO fails at once instead of waiting
/// for a writer; the flag means nothing for a regular file.
///
/// # Errors
///
/// The open error, or [`io::ErrorKind::InvalidInput`] saying what the path is instead.
pub fn open_regular(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let ft = file.metadata()?.file_type();
    if !ft.is_file() {
        return Err(not_regular(ft));
    }
    Ok(file)
}

/// Checks, without opening it, that `path` is an existing regular file (for files another
/// library opens itself).
///
/// # Errors
///
/// As [`open_regular`].
pub fn check_regular(path: &Path) -> io::Result<()> {
    let ft = std::fs::metadata(path)?.file_type();
    if ft.is_file() {
        Ok(())
    } else {
        Err(not_regular(ft))
    }
}

/// Reads the whole of `path`, a regular file of at most `max_bytes`.
///
/// # Errors
///
/// As [`open_regular`], and [`io::ErrorKind::InvalidData`] when the file is larger than
/// `max_bytes` (checked before reading, and again while reading in case it grows).
pub fn read_limited(path: &Path, max_bytes: u64) -> io::Result<Vec<u8>> {
    let file = open_regular(path)?;
    let too_big = |n: u64| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{n} bytes is more than the {max_bytes} bytes expected of this file"),
        )
    };
    let len = file.metadata()?.len();
    if len > max_bytes {
        return Err(too_big(len));
    }
    let mut buf = Vec::with_capacity(len as usize);
    file.take(max_bytes + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > max_bytes {
        return Err(too_big(buf.len() as u64));
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open_regular(&fifo).unwrap_err();
        assert_eq!(e.to_string(), "is a FIFO (named pipe), not a regular file");
        assert!(check_regular(&fifo).is_err());
        let e = read_limited(dir.path(), 10).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
    }

    #[test]
    fn reads_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, b"0123456789").unwrap();
        assert_eq!(read_limited(&f, 10).unwrap().len(), 10);
        let e = read_limited(&f, 9).unwrap_err();
        assert!(e.to_string().contains("10 bytes is more than the 9"), "{e}");
    }
}
