//! The API key `/v1/*` requires, from one of three places: `--api-key KEY` (visible to
//! every user of the machine in the process list), `--api-key-file PATH`, or the
//! environment variable [`API_KEY_ENV`] (as vLLM reads `--api-key` or `VLLM_API_KEY`).
//! At most one may give it, and a key no client could present — empty, surrounded by
//! whitespace, or holding a character an HTTP header cannot carry — is refused at
//! startup, naming where it came from: an empty `--api-key ""` would otherwise turn
//! authentication off while passing the rule that a non-loopback bind needs a key.

use std::ffi::OsString;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The environment variable that may hold the key.
pub const API_KEY_ENV: &str = "LOCKSTEP_API_KEY";

/// The longest key taken, in bytes: far past any generated key (a 256-bit key is 64 hex
/// digits), and it keeps `--api-key-file` from reading a huge file given by mistake.
pub const MAX_API_KEY_BYTES: usize = 4096;

/// Where the key came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// `--api-key KEY`.
    Flag,
    /// `--api-key-file PATH`.
    File(PathBuf),
    /// [`API_KEY_ENV`].
    Env,
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Flag => write!(f, "--api-key"),
            KeySource::File(path) => write!(f, "--api-key-file {}", path.display()),
            KeySource::Env => write!(f, "the environment variable {API_KEY_ENV}"),
        }
    }
}

/// A key that passed the checks, and where it came from.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey {
    /// The key.
    pub key: String,
    /// Where it came from.
    pub source: KeySource,
}

// Never print the key itself.
impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiKey")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

/// Why no key could be taken.
#[derive(Debug, thiserror::Error)]
pub enum ApiKeyError {
    /// Two places gave one.
    #[error("the API key is given twice, by {first} and by {second}: give it one way only")]
    Twice {
        /// The first.
        first: KeySource,
        /// The second.
        second: KeySource,
    },
    /// Empty or only whitespace: it would turn authentication off.
    #[error(
        "{source_of}: the API key is empty{}; an empty key would turn authentication off (to serve without a key, give none)",
        but_for(.whitespace)
    )]
    Empty {
        /// Where it came from.
        source_of: KeySource,
        /// It held whitespace only.
        whitespace: bool,
    },
    /// No client could send it in `Authorization: Bearer KEY`.
    #[error(
        "{source_of}: the API key {why}, which a client cannot send in an `Authorization: Bearer` header; use printable ASCII without surrounding spaces"
    )]
    Unsendable {
        /// Where it came from.
        source_of: KeySource,
        /// What is wrong with it.
        why: String,
    },
    /// Longer than [`MAX_API_KEY_BYTES`].
    #[error("{source_of}: the API key is longer than {MAX_API_KEY_BYTES} bytes")]
    TooLong {
        /// Where it came from.
        source_of: KeySource,
    },
    /// Not UTF-8.
    #[error("{source_of}: the API key is not UTF-8 text")]
    NotUtf8 {
        /// Where it came from.
        source_of: KeySource,
    },
    /// The key file could not be read.
    #[error("--api-key-file {}: {source}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

fn but_for(whitespace: &bool) -> &'static str {
    if *whitespace {
        " but for whitespace"
    } else {
        ""
    }
}

/// The key from `--api-key` (`flag`), `--api-key-file` (`file`) and the environment
/// variable's value (`env`, [`API_KEY_ENV`]): none of them, or exactly one, and then a
/// key a client can send.
pub fn resolve_api_key(
    flag: Option<String>,
    file: Option<&Path>,
    env: Option<OsString>,
) -> Result<Option<ApiKey>, ApiKeyError> {
    let given: Vec<KeySource> = [
        flag.as_ref().map(|_| KeySource::Flag),
        file.map(|p| KeySource::File(p.to_path_buf())),
        env.as_ref().map(|_| KeySource::Env),
    ]
    .into_iter()
    .flatten()
    .collect();
    if let [first, second, ..] = given.as_slice() {
        return Err(ApiKeyError::Twice {
            first: first.clone(),
            second: second.clone(),
        });
    }
    let (key, source) = if let Some(key) = flag {
        (key, KeySource::Flag)
    } else if let Some(path) = file {
        let source = KeySource::File(path.to_path_buf());
        let mut text = read_key_file(path, &source)?;
        // `echo KEY > file` writes a newline no client sends.
        let kept = text.trim_end_matches(['\n', '\r']).len();
        text.truncate(kept);
        (text, source)
    } else if let Some(value) = env {
        let key = value.into_string().map_err(|_| ApiKeyError::NotUtf8 {
            source_of: KeySource::Env,
        })?;
        (key, KeySource::Env)
    } else {
        return Ok(None);
    };
    check_key(&key, &source)?;
    Ok(Some(ApiKey { key, source }))
}

/// At most [`MAX_API_KEY_BYTES`] (and one byte to tell a longer file) are read.
fn read_key_file(path: &Path, source: &KeySource) -> Result<String, ApiKeyError> {
    let read_error = |e| ApiKeyError::Read {
        path: path.to_path_buf(),
        source: e,
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(read_error)?
        .take(MAX_API_KEY_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    // Room for the newline the file may end with.
    if bytes.len() > MAX_API_KEY_BYTES && bytes.trim_ascii_end().len() > MAX_API_KEY_BYTES {
        return Err(ApiKeyError::TooLong {
            source_of: source.clone(),
        });
    }
    String::from_utf8(bytes).map_err(|_| ApiKeyError::NotUtf8 {
        source_of: source.clone(),
    })
}

/// A header value is visible ASCII (actix-web reads any other byte as no key), and
/// HTTP parsers drop the whitespace around it.
fn check_key(key: &str, source: &KeySource) -> Result<(), ApiKeyError> {
    if key.trim().is_empty() {
        return Err(ApiKeyError::Empty {
            source_of: source.clone(),
            whitespace: !key.is_empty(),
        });
    }
    if key.len() > MAX_API_KEY_BYTES {
        return Err(ApiKeyError::TooLong {
            source_of: source.clone(),
        });
    }
    let unsendable = |why: String| {
        Err(ApiKeyError::Unsendable {
            source_of: source.clone(),
            why,
        })
    };
    if key.trim() != key {
        return unsendable("begins or ends with whitespace".into());
    }
    if let Some(c) = key.chars().find(|c| !(' '..='~').contains(c)) {
        return unsendable(format!("holds the character {c:?}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str, contents: &[u8]) -> PathBuf {
        let path = std::env::temp_dir().join(format!("lockstep-key-{name}-{}", std::process::id()));
        std::fs::write(&path, contents).expect("write");
        path
    }

    #[test]
    fn a_key_comes_from_one_place_and_a_file_loses_its_trailing_newline() {
        assert!(resolve_api_key(None, None, None).unwrap().is_none());
        let k = resolve_api_key(Some("abc".into()), None, None)
            .unwrap()
            .unwrap();
        assert_eq!((k.key.as_str(), k.source), ("abc", KeySource::Flag));
        let path = temp_file("newline", b"s3cret key\r\n");
        let k = resolve_api_key(None, Some(&path), None).unwrap().unwrap();
        assert_eq!(k.key, "s3cret key");
        assert_eq!(k.source, KeySource::File(path.clone()));
        let k = resolve_api_key(None, None, Some("from-env".into()))
            .unwrap()
            .unwrap();
        assert_eq!((k.key.as_str(), &k.source), ("from-env", &KeySource::Env));
        // The key itself never shows in a debug print.
        assert!(!format!("{k:?}").contains("from-env"));
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn two_places_are_refused_naming_both() {
        let path = temp_file("twice", b"k\n");
        let cases = [
            (Some("a"), Some(path.as_path()), None, "--api-key-file"),
            (Some("a"), None, Some("b"), API_KEY_ENV),
            (None, Some(path.as_path()), Some("b"), API_KEY_ENV),
        ];
        for (flag, file, env, second) in cases {
            let e = resolve_api_key(flag.map(String::from), file, env.map(OsString::from))
                .expect_err("two sources");
            let m = e.to_string();
            assert!(matches!(e, ApiKeyError::Twice { .. }), "{m}");
            assert!(m.contains("--api-key") && m.contains(second), "{m}");
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_key_no_client_could_send_is_refused_naming_where_it_came_from() {
        let blank = temp_file("blank", b"  \n");
        let long = temp_file("long", &vec![b'k'; MAX_API_KEY_BYTES + 2]);
        let binary = temp_file("binary", b"\xff\xfe");
        let env = |v: &str| Some(OsString::from(v));
        // (--api-key, --api-key-file, LOCKSTEP_API_KEY, the source named, the fault named)
        type Case<'a> = (
            Option<&'a str>,
            Option<&'a Path>,
            Option<OsString>,
            &'a str,
            &'a str,
        );
        let cases: [Case<'_>; 8] = [
            (Some(""), None, None, "--api-key:", "empty"),
            (
                Some(" \t"),
                None,
                None,
                "--api-key:",
                "empty but for whitespace",
            ),
            (None, None, env(""), API_KEY_ENV, "empty"),
            (None, Some(&blank), None, "--api-key-file", "empty"),
            (Some("key "), None, None, "--api-key:", "whitespace"),
            (None, None, env("clé"), API_KEY_ENV, "'é'"),
            (
                None,
                Some(&long),
                None,
                "--api-key-file",
                "longer than 4096",
            ),
            (None, Some(&binary), None, "--api-key-file", "not UTF-8"),
        ];
        for (flag, file, env, named, why) in cases {
            let e = resolve_api_key(flag.map(String::from), file, env)
                .expect_err("refused")
                .to_string();
            assert!(e.contains(named) && e.contains(why), "{named}: {e}");
        }
        let e = resolve_api_key(None, Some(Path::new("/nonexistent/key")), None)
            .expect_err("no such file")
            .to_string();
        assert!(e.contains("--api-key-file /nonexistent/key"), "{e}");
        for p in [blank, long, binary] {
            let _ = std::fs::remove_file(p);
        }
    }
}
