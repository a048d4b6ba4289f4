"""ELECTRA's discriminator fine-tuned against the same classifier from scratch; see README.md."""
