"""Use cases: detect, identify, enroll and verify faces, and the batch import.

The one place where the enrollment rules live (face choice, quality gate, crop, ``NewFace``), used by
the REST gateway (``service/``) and the importer alike. Below it: ``facecore`` (contract, clients,
processing) and ``gallery`` (store, index); above it: the REST routes and the CLIs.
"""
