//! The front door's queue into rank 0 (mechanisms.md §3.2): many producers, one reader
//! (rank 0's fetch), bounded so a flood is refused at the door instead of growing
//! without limit.
//!
//! Rank 0 calls [`IngressQueue::pop_blocking`] when the idle decision says *block* and
//! [`IngressQueue::drain_now`] otherwise. Shutdown is [`IngressQueue::close`]: later
//! pushes are refused, and a blocked reader wakes with `None` once the queue is empty.

use std::collections::VecDeque;

use crate::sync::{Arc, Condvar, Deadline, Mutex};

/// What a timed read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Popped<T> {
    /// The oldest item.
    Item(T),
    /// Nothing came before the deadline.
    TimedOut,
    /// The queue is closed and empty: nothing will ever come.
    Closed,
}

/// A refused push. Nothing was enqueued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IngressError {
    /// The queue holds `capacity` items already.
    #[error("ingress queue full ({capacity} items)")]
    Full {
        /// The queue's bound.
        capacity: usize,
    },
    /// The queue was closed (shutdown).
    #[error("ingress queue closed")]
    Closed,
}

/// A bounded multi-producer queue; clones share one queue.
#[derive(Debug)]
pub struct IngressQueue<T> {
    inner: Arc<Inner<T>>,
}

#[derive(Debug)]
struct Inner<T> {
    capacity: usize,
    state: Mutex<QueueState<T>>,
    /// Notified on push and on close.
    readable: Condvar,
}

#[derive(Debug)]
struct QueueState<T> {
    items: VecDeque<T>,
    closed: bool,
}

impl<T> Clone for IngressQueue<T> {
    fn clone(&self) -> Self {
        IngressQueue {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T> IngressQueue<T> {
    /// An open, empty queue holding at most `capacity` items (0 refuses everything).
    pub fn new(capacity: usize) -> IngressQueue<T> {
        IngressQueue {
            inner: Arc::new(Inner {
                capacity,
                state: Mutex::new(QueueState {
                    items: VecDeque::new(),
                    closed: false,
                }),
                readable: Condvar::new(),
            }),
        }
    }

    /// The bound given at construction.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Appends `item`, or refuses it (queue full or closed) and changes nothing.
    pub fn push(&self, item: T) -> Result<(), IngressError> {
        let mut st = self.inner.state.lock();
        if st.closed {
            return Err(IngressError::Closed);
        }
        if st.items.len() >= self.inner.capacity {
            return Err(IngressError::Full {
                capacity: self.inner.capacity,
            });
        }
        st.items.push_back(item);
        drop(st);
        self.inner.readable.notify_one();
        Ok(())
    }

    /// Appends every item of `items` at once (a reader sees all or none of them), or
    /// refuses them all (the queue has no room for all, or is closed) and changes
    /// nothing.
    pub fn push_all(&self, items: impl IntoIterator<Item = T>) -> Result<(), IngressError> {
        let items: Vec<T> = items.into_iter().collect();
        let mut st = self.inner.state.lock();
        if st.closed {
            return Err(IngressError::Closed);
        }
        if st.items.len() + items.len() > self.inner.capacity {
            return Err(IngressError::Full {
                capacity: self.inner.capacity,
            });
        }
        st.items.extend(items);
        drop(st);
        self.inner.readable.notify_one();
        Ok(())
    }

    /// Appends every item of `items` at once whatever the bound (control items, which
    /// must never be refused while the reader runs), or refuses them if the queue is
    /// closed.
    pub fn push_all_unbounded(
        &self,
        items: impl IntoIterator<Item = T>,
    ) -> Result<(), IngressError> {
        let mut st = self.inner.state.lock();
        if st.closed {
            return Err(IngressError::Closed);
        }
        st.items.extend(items);
        drop(st);
        self.inner.readable.notify_one();
        Ok(())
    }

    /// The oldest item, waiting until `deadline` at most (under loom a deadline never
    /// passes: the read waits for an item or the close).
    pub fn pop_until(&self, deadline: &Deadline) -> Popped<T> {
        let mut st = self.inner.state.lock();
        loop {
            if let Some(item) = st.items.pop_front() {
                return Popped::Item(item);
            }
            if st.closed {
                return Popped::Closed;
            }
            let timed_out;
            (st, timed_out) = self.inner.readable.wait_until(st, deadline);
            if timed_out && st.items.is_empty() && !st.closed {
                return Popped::TimedOut;
            }
        }
    }

    /// The oldest item, blocking until there is one; `None` once closed and empty.
    pub fn pop_blocking(&self) -> Option<T> {
        let mut st = self.inner.state.lock();
        loop {
            if let Some(item) = st.items.pop_front() {
                return Some(item);
            }
            if st.closed {
                return None;
            }
            st = self.inner.readable.wait(st);
        }
    }

    /// The oldest item if one is queued now, without waiting.
    pub fn try_pop(&self) -> Option<T> {
        self.inner.state.lock().items.pop_front()
    }

    /// Everything queued now, oldest first, without waiting.
    pub fn drain_now(&self) -> Vec<T> {
        self.inner.state.lock().items.drain(..).collect()
    }

    /// Refuses later pushes and wakes blocked readers. Items already queued stay
    /// readable. Idempotent.
    pub fn close(&self) {
        self.inner.state.lock().closed = true;
        self.inner.readable.notify_all();
    }

    /// Whether [`IngressQueue::close`] was called. A poller that checks this *before*
    /// [`IngressQueue::drain_now`] and sees `true` has drained everything that will
    /// ever arrive (pushes after close are refused).
    pub fn is_closed(&self) -> bool {
        self.inner.state.lock().closed
    }

    /// Items queued now.
    pub fn len(&self) -> usize {
        self.inner.state.lock().items.len()
    }

    /// Whether nothing is queued now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
