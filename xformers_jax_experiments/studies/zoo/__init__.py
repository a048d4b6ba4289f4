"""Every causal kind on associative recall, selective copying and induction heads; see
README.md."""
