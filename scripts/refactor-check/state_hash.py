#!/usr/bin/env python3
"""Prints the sha256 of a Tandem snapshot's numbers: its tensors (flat parameters, BN
buffers, optimizer slots), the BN batch count and optimizer step, and every loss and
accuracy of its history. Timings and paths are left out, so two runs that computed the
same numbers print the same line."""

import hashlib
import json
import struct
import sys

TIMING_FIELDS = {"seconds", "epoch_seconds", "images_per_second", "time", "wall_seconds"}


def numbers_of(record):
    """The record's fields without timings, in a stable order."""
    return {key: value for key, value in sorted(record.items())
            if not any(word in key for word in TIMING_FIELDS)}


def state_hash(path):
    with open(path, "rb") as file:
        data = file.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    body = data[8 + header_len:]
    metadata = header.pop("__metadata__", {})
    description = json.loads(metadata["tandem.snapshot"])
    digest = hashlib.sha256()
    for name in sorted(header):
        start, end = header[name]["data_offsets"]
        digest.update(name.encode())
        digest.update(body[start:end])
    digest.update(str(description["num_batches_tracked"]).encode())
    digest.update(str(description["optimizer_step"]).encode())
    progress = description["progress"]
    digest.update(repr(progress["epoch_loss_sum"]).encode())
    for record in description["history"]:
        digest.update(json.dumps(numbers_of(record), sort_keys=True).encode())
    return digest.hexdigest(), sorted(header), len(description["history"])


if __name__ == "__main__":
    for path in sys.argv[1:]:
        value, tensors, epochs = state_hash(path)
        print(f"{value}  {path}  ({', '.join(tensors)}; {epochs} epoch records)")
