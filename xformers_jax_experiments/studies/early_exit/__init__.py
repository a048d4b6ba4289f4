"""Early exit on the ListOps main job (DeeBERT entropy thresholds, PABEE patience); see
README.md."""
