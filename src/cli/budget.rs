//! A refused budget named by the flag the user typed: `run --mem-gb` or `--preset`, `bench
//! --budgets`, `tune --mem-gb`, `demo --budget-share`. The plan's own message states only the
//! budget in GB, since the library does not know which flag gave it.

use crate::engine::measure::MeasureError;
use crate::engine::OpenError;
use crate::error::UsageError;
use crate::storage::plan::PlanError;

/// `err` as a usage error led by `flag` when the plan refused the budget; otherwise unchanged.
/// The context between the flag and the plan's message ("opening model ...") is dropped: the
/// budget, not the model, is what the user has to change.
pub(super) fn name_budget_flag(err: anyhow::Error, flag: &str) -> anyhow::Error {
    match err.chain().find_map(plan_refusal) {
        // The piece size has a flag of its own.
        Some(plan @ PlanError::PieceTooSmall { .. }) => UsageError(format!("--piece-mb: {plan}")).into(),
        Some(plan) => UsageError(format!("{flag}: {plan}")).into(),
        None => err,
    }
}

/// The plan's refusal in `cause`, looking inside the errors that wrap it transparently (their
/// `source()` skips it).
fn plan_refusal<'a>(cause: &'a (dyn std::error::Error + 'static)) -> Option<&'a PlanError> {
    let open = |e: &'a OpenError| match e {
        OpenError::Plan(plan) => Some(plan),
        _ => None,
    };
    if let Some(plan) = cause.downcast_ref::<PlanError>() {
        return Some(plan);
    }
    if let Some(e) = cause.downcast_ref::<OpenError>() {
        return open(e);
    }
    match cause.downcast_ref::<MeasureError>() {
        Some(MeasureError::Open(e)) => open(e),
        _ => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use anyhow::Context;

    use super::name_budget_flag;
    use crate::engine::measure::MeasureError;
    use crate::engine::OpenError;
    use crate::error::exit_code_for;
    use crate::exit::ExitCode;
    use crate::storage::plan::PlanError;

    #[test]
    fn a_plan_refusal_is_led_by_the_flag_and_other_errors_pass_through() {
        let below = PlanError::BelowMinimum { budget_gb: 0.0, min_gb: 0.001, detail: "x".into() };
        let wrapped = Err::<(), _>(below).context("opening model m").unwrap_err();
        let named = name_budget_flag(wrapped, "--budget-share 0.000001");
        assert_eq!(exit_code_for(&named), ExitCode::Usage);
        let text = named.to_string();
        assert!(text.starts_with("--budget-share 0.000001: a budget of 0.0000 GB is below"), "{text}");
        assert!(!text.contains("--mem-gb") && !text.contains("opening model"), "{text}");

        let measured = MeasureError::Open(OpenError::Plan(PlanError::AboveAvailable {
            budget_gb: 9.0,
            available_gb: 1.0,
            max_gb: 0.95,
            limited_by: "MemAvailable".into(),
        }));
        let named =
            name_budget_flag(Err::<(), _>(measured).context("budget 9 GB, mode serial").unwrap_err(), "--budgets 9");
        assert!(named.to_string().starts_with("--budgets 9: a budget of 9.000 GB is above"), "{named}");

        let other = name_budget_flag(anyhow::anyhow!("disk on fire"), "--mem-gb 1");
        assert_eq!(other.to_string(), "disk on fire");
    }
}
