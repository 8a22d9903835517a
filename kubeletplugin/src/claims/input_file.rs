//! Reading the plugin's input files (checkpoint, boot id, `--fake-claims`, `--fake-inventory`)
//! within bounds: only a regular file (a symlink to one is fine: `ConfigMap` volumes are mounted
//! that way), at most [`MAX_INPUT_BYTES`]. A device, FIFO or socket is refused before a byte is read
//! (a symlink to `/dev/zero` would otherwise grow the plugin without end), and so is a larger
//! file, with an error naming the path and the rule.

use std::fs::OpenOptions;
use std::io::Read as _;
use std::os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _};
use std::path::Path;

use tessera_driver::rules::limits::MAX_INPUT_BYTES;

use crate::error::{Error, Result};

/// The bytes of the regular file at `path`; `what` names the file in errors ("the checkpoint").
/// A missing file is an [`Error::Io`] whose kind is `NotFound`, so callers can tell it apart.
pub fn read(path: &Path, what: &str) -> Result<Vec<u8>> {
    // Non-blocking, so that opening a FIFO does not wait for a writer; a regular file ignores
    // the flag.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits().cast_signed())
        .open(path)
        .map_err(|e| Error::io("opening", path, e))?;
    let meta = file
        .metadata()
        .map_err(|e| Error::io("reading the type of", path, e))?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let found = if kind.is_dir() {
            "a directory"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(Error::Input {
            path: path.to_owned(),
            message: format!("{what} must be a regular file, and this is {found}"),
        });
    }
    let limit = u64::try_from(MAX_INPUT_BYTES).unwrap_or(u64::MAX);
    if meta.len() > limit {
        return Err(too_large(path, what));
    }
    // The size can change while we read (and /proc files say 0): the read itself is bounded.
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io("reading", path, e))?;
    if bytes.len() > MAX_INPUT_BYTES {
        return Err(too_large(path, what));
    }
    Ok(bytes)
}

/// [`read`], as UTF-8 text.
pub fn read_text(path: &Path, what: &str) -> Result<String> {
    String::from_utf8(read(path, what)?).map_err(|e| Error::Input {
        path: path.to_owned(),
        message: format!("{what} is not UTF-8 text: {e}"),
    })
}

fn too_large(path: &Path, what: &str) -> Error {
    Error::Input {
        path: path.to_owned(),
        message: format!(
            "{what} is larger than {} MiB, the most the plugin reads",
            MAX_INPUT_BYTES >> 20
        ),
    }
}

/// Whether `error` says the file does not exist.
pub fn is_missing(error: &Error) -> bool {
    matches!(error, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regular_file_and_a_symlink_to_one_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"boot-1\n").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(read(&file, "the file").unwrap(), b"boot-1\n");
        assert_eq!(read_text(&link, "the file").unwrap(), "boot-1\n");
    }

    #[test]
    fn a_device_a_fifo_and_a_directory_are_refused_before_reading() {
        let dir = tempfile::tempdir().unwrap();
        let zero = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let err = read(&zero, "the boot id file").unwrap_err().to_string();
        assert!(
            err.contains("must be a regular file, and this is a device"),
            "{err}"
        );
        assert!(err.contains(&zero.display().to_string()), "{err}");
        let fifo = dir.path().join("fifo");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
        )
        .unwrap();
        let err = read(&fifo, "the checkpoint").unwrap_err().to_string();
        assert!(err.contains("this is a FIFO"), "{err}");
        let err = read(dir.path(), "the checkpoint").unwrap_err().to_string();
        assert!(err.contains("this is a directory"), "{err}");
    }

    #[test]
    fn a_file_over_the_limit_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big");
        // Sparse: no disk is used.
        let file = std::fs::File::create(&big).unwrap();
        file.set_len(u64::try_from(MAX_INPUT_BYTES).unwrap() + 1)
            .unwrap();
        let err = read(&big, "--fake-claims").unwrap_err().to_string();
        assert!(err.contains("larger than 64 MiB"), "{err}");
        file.set_len(u64::try_from(MAX_INPUT_BYTES).unwrap())
            .unwrap();
        assert_eq!(read(&big, "--fake-claims").unwrap().len(), MAX_INPUT_BYTES);
    }

    #[test]
    fn a_missing_file_is_told_apart() {
        let err = read(Path::new("/nonexistent/tessera"), "the checkpoint").unwrap_err();
        assert!(is_missing(&err), "{err}");
    }
}
