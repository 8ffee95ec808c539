"""Checkpoints that outlive the cluster: a checkpoint store (an S3-compatible bucket, GCS, Azure, or a
directory on a NAS the head mounts), what is written there and how, and what is kept. The store's URL
and where each checkpoint's objects lie in it: ``coordinator/config/store_url.py``.

- ``manifest``: what a committed checkpoint in the store holds, written last (pure);
- ``policy``: what to upload next, what the store keeps, how far behind it is (pure);
- ``objects``: the store itself, through obstore (effects);
- ``transfer``: a checkpoint's bytes into the store and back, each part and file checked (effects).
"""
