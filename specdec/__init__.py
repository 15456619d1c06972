"""specdec: speculative decoding split into gRPC services.

This package holds what the draft and target servers share (model loading,
the KV session pool, sampling transforms, server plumbing) and the generated
protobuf code under ``specdec.v1``.
"""

__version__ = "0.1.0"
