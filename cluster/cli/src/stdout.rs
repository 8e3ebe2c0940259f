//! The command line's output on stdout, which a reader that goes away does not turn into
//! a panic: `lockstep profiles | head -1` shows its line and the command goes on to its
//! own exit status, where `println!` panics on the broken pipe (status 101 and a
//! backtrace). Once stdout fails, the rest of the output is dropped: a server or a long
//! run keeps going (nothing a reader does takes it down) and still exits as it would.

use std::fmt;
use std::io::{ErrorKind, Write};
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once a write to stdout has failed: what follows is not written.
static FAILED: AtomicBool = AtomicBool::new(false);

/// Writes `args` to stdout, unless an earlier write failed. A reader gone away (a broken
/// pipe) is silent; any other failure (a full disk) is said once on stderr.
pub(crate) fn write(args: fmt::Arguments<'_>) {
    if FAILED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    if let Err(error) = out.write_fmt(args).and_then(|()| out.flush()) {
        FAILED.store(true, Ordering::Relaxed);
        if error.kind() != ErrorKind::BrokenPipe {
            crate::output::print_error(&format!("writing to stdout: {error}"));
        }
    }
}

/// `print!` through [`write`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::stdout::write(format_args!($($arg)*))
    };
}

/// `println!` through [`write`].
macro_rules! outln {
    () => {
        $crate::stdout::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::stdout::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {out, outln};
