"""Data that resumes at the exact sample on any world size: the global sample order (`sampling`), DataLoaders whose
workers survive a stop (`loader`), sharded file streams (`stream`) and Stateful iterables (`stream_loader`).
Imports `mgpu.stop` and below.
"""
