"""What training adds: rewards, checkpoints, training metrics, verl patches."""
