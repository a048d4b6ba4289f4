"""Whether the input pipeline is on the main job's critical path; see README.md."""
