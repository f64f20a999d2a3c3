//! The crate's one error type (house style rule 19).

use crate::isa::{available_names, Isa};

/// Errors a kernel reports about its *data* or the host. Shape mismatches are programming errors
/// and panic instead.
#[non_exhaustive]
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// An MXFP4 scale byte is 0xFF, which OCP E8M0 reserves for NaN: the tensor is corrupt.
    /// `row` is the output row and `group` the 32-column group (`weight_scale[row, group]`); it is
    /// the first such byte in row-major order.
    #[error(
        "MXFP4 scale byte 0xFF (NaN in E8M0) at row {row}, group {group}: the tensor is corrupt; \
         re-download or re-pack the checkpoint shard that holds it"
    )]
    BadScale {
        /// Output row (index along the weight's first axis).
        row: usize,
        /// 32-element group along the contraction axis.
        group: usize,
    },
    /// The requested instruction set cannot run on this host.
    #[error(
        "instruction set `{0}` is not available on this CPU (or the OS does not enable it); \
         choose one of: {names}",
        names = available_names()
    )]
    IsaUnavailable(Isa),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_scale_message_names_position_and_fix() {
        let e = KernelError::BadScale { row: 3, group: 7 };
        assert_eq!(
            e.to_string(),
            "MXFP4 scale byte 0xFF (NaN in E8M0) at row 3, group 7: the tensor is corrupt; \
             re-download or re-pack the checkpoint shard that holds it"
        );
    }

    #[test]
    fn isa_message_lists_choices() {
        let e = KernelError::IsaUnavailable(Isa::Avx2);
        let text = e.to_string();
        assert!(text.starts_with("instruction set `avx2` is not available"), "{text}");
        assert!(text.ends_with(&available_names()), "{text}");
    }
}
