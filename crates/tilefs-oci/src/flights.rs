//! Fetches of objects under way in this process, by digest: the first
//! reader of an absent object leads its fetch, and readers that come while
//! it runs wait for its answer instead of fetching the object again. The
//! answer is forgotten once given: after a failure, the next reader tries
//! again. (Other processes are kept apart by the store's fetch locks,
//! [`tilefs_store::fetch_lock`].)

use rustc_hash::FxHashMap;
use std::sync::{Arc, Condvar, Mutex};

/// The fetches under way.
#[derive(Default)]
pub(crate) struct Flights {
    under_way: Mutex<FxHashMap<[u8; 32], Arc<Flight>>>,
}

/// One fetch of one object, and its answer once there is one.
#[derive(Default)]
pub(crate) struct Flight {
    answer: Mutex<Option<Result<(), String>>>,
    given: Condvar,
}

/// What a reader of an object does: lead its fetch, or wait for one.
pub(crate) enum Joined<'a> {
    Lead(Lead<'a>),
    Follow(Arc<Flight>),
}

impl Flights {
    /// Leads the fetch of `digest`, or follows the one under way.
    pub(crate) fn join(&self, digest: &[u8; 32]) -> Joined<'_> {
        let mut map = self.under_way.lock().unwrap();
        if let Some(f) = map.get(digest) {
            return Joined::Follow(f.clone());
        }
        Joined::Lead(self.start(&mut map, digest))
    }

    /// Leads the fetch of `digest` unless one is under way.
    pub(crate) fn try_lead(&self, digest: &[u8; 32]) -> Option<Lead<'_>> {
        let mut map = self.under_way.lock().unwrap();
        (!map.contains_key(digest)).then(|| self.start(&mut map, digest))
    }

    fn start(&self, map: &mut FxHashMap<[u8; 32], Arc<Flight>>, digest: &[u8; 32]) -> Lead<'_> {
        let flight = Arc::new(Flight::default());
        map.insert(*digest, flight.clone());
        Lead {
            flights: self,
            digest: *digest,
            flight,
            answered: false,
        }
    }
}

impl Flight {
    /// Waits for the answer of the fetch (which its leader always gives).
    pub(crate) fn wait(&self) -> Result<(), String> {
        let mut answer = self.answer.lock().unwrap();
        loop {
            if let Some(a) = &*answer {
                return a.clone();
            }
            answer = self.given.wait(answer).unwrap();
        }
    }
}

/// The fetch of one object that this reader leads.
pub(crate) struct Lead<'a> {
    flights: &'a Flights,
    digest: [u8; 32],
    flight: Arc<Flight>,
    answered: bool,
}

impl Lead<'_> {
    pub(crate) fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// Gives the answer to every reader waiting, and lets the next reader
    /// lead a new fetch.
    pub(crate) fn answer(mut self, result: Result<(), String>) {
        self.give(result);
    }

    fn give(&mut self, result: Result<(), String>) {
        self.answered = true;
        self.flights.under_way.lock().unwrap().remove(&self.digest);
        *self.flight.answer.lock().unwrap() = Some(result);
        self.flight.given.notify_all();
    }
}

impl Drop for Lead<'_> {
    /// A fetch abandoned without an answer (a panic) still answers: no
    /// reader may wait for ever.
    fn drop(&mut self) {
        if !self.answered {
            self.give(Err("the fetch was abandoned".into()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn followers_get_the_leaders_answer_and_failures_are_not_kept() {
        let flights = Flights::default();
        let d = [7u8; 32];
        let Joined::Lead(lead) = flights.join(&d) else {
            panic!("first reader leads")
        };
        assert!(flights.try_lead(&d).is_none());
        let Joined::Follow(f) = flights.join(&d) else {
            panic!("second reader follows")
        };
        std::thread::scope(|s| {
            let waiter = s.spawn(|| f.wait());
            std::thread::sleep(std::time::Duration::from_millis(20));
            lead.answer(Err("registry away".into()));
            assert_eq!(waiter.join().unwrap(), Err("registry away".into()));
        });
        let Joined::Lead(again) = flights.join(&d) else {
            panic!("after a failure, the next reader leads")
        };
        let Joined::Follow(f) = flights.join(&d) else { panic!() };
        drop(again);
        assert!(f.wait().is_err(), "an abandoned fetch answers");
        assert!(flights.try_lead(&d).is_some());
    }
}
