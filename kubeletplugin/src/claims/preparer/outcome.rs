//! A call's outcomes: one per claim, each decided once, and a failure shared by many claims
//! given to each of them.

use crate::error::{Error, Result};

/// The one outcome of a call made for one claim (`prepare_all(vec![claim])`, ...).
pub(crate) trait OneOutcome<T> {
    /// The outcome, or an error when the call answered none.
    fn only_outcome(self) -> Result<T>;
}

impl<T> OneOutcome<T> for Vec<Result<T>> {
    fn only_outcome(mut self) -> Result<T> {
        self.pop()
            .unwrap_or_else(|| Err(Error::Task("no answer for the claim".to_owned())))
    }
}

/// What each claim of a call came to; `None` while undecided.
pub(super) type Outcomes<T> = Vec<Option<Result<T>>>;

pub(super) fn finish<T>(outcomes: Outcomes<T>) -> Vec<Result<T>> {
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Err(Error::Task("a claim was left without an answer".into()))))
        .collect()
}

/// One failure (of a write shared by many claims) as each claim's error.
pub(super) fn shared(error: &Error) -> Error {
    match error {
        Error::Cancelled => Error::Cancelled,
        other => Error::Shared(other.to_string()),
    }
}

/// The call's outcomes when a step shared by its claims failed with `error`: each claim not
/// answered yet gets it.
pub(super) fn fail_unanswered<T>(mut outcomes: Outcomes<T>, error: &Error) -> Vec<Result<T>> {
    for o in outcomes.iter_mut().filter(|o| o.is_none()) {
        *o = Some(Err(shared(error)));
    }
    finish(outcomes)
}
