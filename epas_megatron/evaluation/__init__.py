"""Quality evaluation: which sharing regions to evaluate, validation at several regions during
training, and the bridge to EleutherAI's lm-evaluation-harness."""
