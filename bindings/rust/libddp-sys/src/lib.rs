//! Raw declarations of `include/ddp.h`, one to one. Widths follow the header: `size_t` is `usize`,
//! `int` is `c_int`, enums are `c_int`, handles are opaque pointers, callbacks are
//! `Option<unsafe extern "C" fn>`. Everything below is generated from the header by
//! `tools/gen_bindings.py` into `src/generated.rs`; `make bindings-check` (CI) fails while it differs.
#![allow(non_camel_case_types)]

include!("generated.rs");
