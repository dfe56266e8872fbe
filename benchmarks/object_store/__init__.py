"""An S3 server on 127.0.0.1 (moto) and a proxy in front of it that adds latency, counts bytes and
injects faults: shared by ``benchmarks.object_storage`` and the remote-storage tests."""
