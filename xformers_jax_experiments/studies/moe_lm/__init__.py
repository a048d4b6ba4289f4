"""Switch against the dense FFN on the byte-level LM; see README.md."""
