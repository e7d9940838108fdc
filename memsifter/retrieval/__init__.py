"""Rankings, rendering sessions, the one prompt builder (the session window) and the metrics."""
