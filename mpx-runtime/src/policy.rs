//! jmp-style precision policies (param / compute / output) and their strings.
