"""The field's formats for the pipeline: Parquet, HDF5 and Zarr, each behind the ``formats`` extra.

Each module holds one format's source (rows read by every rank itself,
the protocol of :mod:`spmd.pipeline.sources`) and sink; the libraries
(pyarrow, h5py, zarr) are imported only when a file of theirs is named,
and a missing one is an error naming the extra (:mod:`.extra`).
:func:`spmd.pipeline.sources.open_source` and
:func:`spmd.pipeline.outputs.open_sink` choose among them by the path
(:mod:`.names`).
"""
