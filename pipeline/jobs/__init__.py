"""Real training runs: a HF model directory trained on data from disk (`pipesched run`)."""
