"""The ListOps compression figures over seeds and where an int8 checkpoint's bytes go; see
README.md."""
