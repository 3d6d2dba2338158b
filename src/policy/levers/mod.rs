//! Memory levers: each term of the memory bill that a run can trade for time, one file per
//! lever behind one trait (`lever`), and one registry line each.
//!
//! A lever says whether it applies (purely, from where the run stands, with a reason when it
//! does not), what engaging it does to the run's position (pure, so `Recovery` decides without
//! libtorch) and to the parts (the model, its optimizers and the forward part), what `check`'s
//! estimate says of it and how `fit` searches it. `Recovery` alone decides which levers are
//! engaged; checkpoints persist its `Position` (engaged levers by name, and the batch shape),
//! and summary counts and OOM decisions are keyed by the lever's name.
mod backoff;
mod cpu;
mod host_activations;
mod host_grads;
mod host_params;
mod host_state;
mod lever;
mod placement;
mod recompute;

use crate::estimate::Estimate;
use crate::spec::schema::{Memory, OomAction, Train};

pub use backoff::Backoff;
pub use cpu::CpuFallback;
pub use host_activations::HostActivations;
pub use host_grads::HostGrads;
pub use host_params::HostParams;
pub use host_state::HostState;
pub use lever::{About, Described, Engaged, Lever, Position, Search, Situation, Target};
pub use recompute::Recompute;

/// Every lever, in the order `check` lists them and an OOM action that answers for several
/// tries them. Adding one: its file and one line here.
pub static LEVERS: &[&dyn Lever] = &[
    &Recompute,
    &HostState,
    &HostGrads,
    &HostActivations,
    &HostParams,
    &Backoff,
    &CpuFallback,
];

/// The levers a `memory.on_oom` word engages, in the order tried ("offload": each placement in
/// turn; the others: their one lever). Empty for "fail".
pub fn answering(word: &str) -> Vec<&'static dyn Lever> {
    LEVERS.iter().copied().filter(|l| l.answers() == word).collect()
}

/// The lever of this name (a name from the spec, a checkpoint or a record).
pub fn lever(name: &str) -> Option<&'static dyn Lever> {
    LEVERS.iter().copied().find(|l| l.name() == name)
}

/// The lever an OOM record's decision engaged (None: the run failed, or an action this memtrain
/// does not know).
pub fn by_action(action: &str) -> Option<&'static dyn Lever> {
    LEVERS.iter().copied().find(|l| l.action() == action)
}

/// The engaged levers themselves.
pub fn engaged(e: &Engaged) -> impl Iterator<Item = &'static dyn Lever> + '_ {
    e.names().iter().filter_map(|n| lever(n))
}

/// Engaged levers from their names (a checkpoint's); an unknown name is an error that says
/// which levers this memtrain knows.
pub fn from_names<S: AsRef<str>>(names: &[S]) -> Result<Engaged, String> {
    names
        .iter()
        .try_fold(Engaged::default(), |e, n| match lever(n.as_ref()) {
            Some(l) => Ok(e.with(l.name())),
            None => Err(format!(
                "unknown lever {:?} (this memtrain knows {})",
                n.as_ref(),
                LEVERS.iter().map(|l| l.name()).collect::<Vec<_>>().join(", ")
            )),
        })
}

/// How `fit` treats each lever, for its opening lines: the levers it searches, and why it skips
/// the others.
pub fn fit_line() -> String {
    let each: Vec<String> = LEVERS
        .iter()
        .map(|l| match l.search() {
            Search::Toggle => format!("{}: one axis of the settings, off and on", l.name()),
            Search::Size => format!("{}: searched by size, the largest micro-batch that fits", l.name()),
            Search::Ladder => format!(
                "{}: a rung of the placement ladder, climbed only while micro-batch 1 does not fit",
                l.name()
            ),
            Search::Never(why) => format!("{}: not searched ({why})", l.name()),
        })
        .collect();
    format!("levers: {}", each.join("; "))
}

/// The levers the spec's sections turn on from the start, with the key that does.
pub fn configured(train: &Train, m: &Memory) -> Vec<(&'static str, &'static dyn Lever)> {
    let from_start: [(bool, &'static dyn Lever); 5] = [
        (train.activation_checkpointing, &Recompute),
        (m.optimizer_state.is_host(), &HostState),
        (m.gradients.is_host(), &HostGrads),
        (m.activations.is_host(), &HostActivations),
        (m.parameters.is_host(), &HostParams),
    ];
    from_start
        .into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, l)| (l.about().setting.expect("a lever the spec turns on names its key"), l))
        .collect()
}

/// `check`'s levers section: each lever as a run in situation `s` would start, under
/// `memory.on_oom` and with the levers its spec turns on from the start (`configured`).
pub fn check_lines(e: &Estimate, s: &Situation, on_oom: &[OomAction], configured: &[(&str, &dyn Lever)]) -> String {
    let on_oom: Vec<&str> = on_oom.iter().map(|a| a.name()).collect();
    // With what each brings along (streamed parameters: recomputation, host state and gradients).
    let by_spec = configured.iter().fold(Engaged::default(), |e, (_, l)| {
        let at = Situation {
            at: Position { engaged: e, ..s.at },
            ..*s
        };
        match l.applies(&at) {
            Ok(()) => l.engaged(&at).engaged,
            Err(_) => e.with(l.name()),
        }
    });
    bill_lines(e, s, &on_oom, by_spec)
}

/// `check`'s lines on the levers: what each would do to the bill, and when it comes into play
/// under the spec (`engaged_by_spec`: levers the spec turns on from the start).
pub fn bill_lines(e: &Estimate, s: &Situation, on_oom: &[&str], engaged_by_spec: Engaged) -> String {
    let mut out = String::from("levers           what each would do to the bill, and when it comes in\n");
    for l in LEVERS {
        let when = if engaged_by_spec.contains(l.name()) {
            "on from the start (spec)".to_owned()
        } else {
            match on_oom.iter().position(|a| *a == l.answers()) {
                Some(k) => format!("on an OOM (memory.on_oom entry {})", k + 1),
                None => "not in memory.on_oom".to_owned(),
            }
        };
        let effect = match l.applies(s) {
            Ok(()) => l.estimate(e),
            Err(why) => format!("does not apply: {why}"),
        };
        out += &format!("  {:<20} {when}; {effect}\n", l.name());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::OomAction;

    #[test]
    fn every_on_oom_action_but_fail_answers_with_levers_and_names_are_unique() {
        for a in OomAction::ALL {
            match a {
                OomAction::Fail => assert!(answering(a.name()).is_empty()),
                OomAction::Offload => assert_eq!(
                    answering(a.name()).iter().map(|l| l.name()).collect::<Vec<_>>(),
                    [
                        "host_optimizer_state",
                        "host_gradients",
                        "host_activations",
                        "host_parameters"
                    ]
                ),
                _ => assert_eq!(
                    answering(a.name()).iter().map(|l| l.name()).collect::<Vec<_>>(),
                    [a.name()]
                ),
            }
        }
        let mut names: Vec<_> = LEVERS.iter().map(|l| l.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), LEVERS.len());
    }

    #[test]
    fn engaged_levers_travel_as_their_names() {
        let e = Engaged::default().with("cpu").with("recompute").with("cpu");
        assert!(e.contains("cpu") && e.contains("recompute") && !e.contains("backoff"));
        assert_eq!(e.names(), ["cpu", "recompute"], "in the order engaged, once each");
        assert_eq!(from_names(e.names()), Ok(e));
        assert_eq!(
            engaged(&e).map(|l| l.counted_as()).collect::<Vec<_>>(),
            ["cpu_fallbacks", "recomputes"]
        );
        let err = from_names(&["swap"]).unwrap_err();
        assert!(err.contains("unknown lever \"swap\""), "{err}");
    }
}
