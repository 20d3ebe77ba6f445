"""The batch sizes CUDA graphs are captured at (``cuda_graphs.py``; a step's requests are padded up
to one, as vLLM pads), apart so that the planner pads as the engine does without importing torch."""

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
