import gc
gc.set_threshold(50000, 20, 100)
