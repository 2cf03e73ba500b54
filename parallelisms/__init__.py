"""Parallelisms, each one file touching the model through documented seams; parallelize.py applies them (the one
build path: `build_model_parts`)."""
