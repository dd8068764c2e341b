# Tandem's container image: `docker build -t tandem .` (see README, "Container image").
#
# Stage 1 builds the binary with the official Rust image; stage 2 is a slim Debian with the
# binary only. No CUDA library is baked in: Tandem loads them at run time when it finds them
# (the NVIDIA container toolkit mounts the driver's libcuda; cuDNN, cuBLAS, NVRTC and NCCL
# come from a CUDA base image or a mounted folder named by TANDEM_CUDA_LIBRARY_PATH).

# The base of the image that runs: a CUDA runtime image with cuDNN may replace it
# (`--build-arg RUNTIME_IMAGE=...`) to carry the CUDA libraries.
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p tandem

FROM ${RUNTIME_IMAGE}
# `--download` (ureq) carries its own CA roots; object storage over https (object_store's
# reqwest) trusts the system's, so the image has them.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/tandem /usr/local/bin/tandem
# What the NVIDIA container toolkit should expose when the container runs with `--gpus`.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /work
ENTRYPOINT ["tandem"]
CMD ["--help"]
