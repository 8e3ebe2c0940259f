//! A scratch folder per test, under Cargo's target/tmp, removed when the test ends.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// A folder named after the test binary, `name` and the process; removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// The folder, created empty.
    pub fn new(name: &str) -> Self {
        let dir = TempDir::unmade(name);
        std::fs::create_dir_all(&dir.0).unwrap();
        dir
    }

    /// The folder's path, with nothing there yet (for commands that make it).
    pub fn unmade(name: &str) -> Self {
        let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "{}-{name}-{}",
            env!("CARGO_CRATE_NAME"),
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&path);
        TempDir(path)
    }

    /// A path inside the folder, as a string for a command line.
    pub fn file(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
