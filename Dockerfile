# syntax=docker/dockerfile:1
# The project image: producer, short/long workers, Flower, the metrics endpoint and the
# SGLang simulator. `--build-arg EXTRAS=extract` adds torch for the hidden-state extraction
# worker (`datagen worker gpu`); torch's wheels carry their CUDA libraries, so the host
# needs only the NVIDIA driver and container toolkit.
FROM python:3.11-slim

ARG EXTRAS=""
ARG TORCH="torch==2.13.0"
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/tmp/huggingface

WORKDIR /app
COPY pyproject.toml README.md ./
COPY requirements requirements
# Exactly the locked environment the tests run in (requirements/lock.txt), torch pinned too.
# The lock pins every dependency but torch (installed first, for the extract image only).
RUN case ",${EXTRAS}," in *,extract,*|*,gpu,*) pip install "${TORCH}" ;; esac \
    && pip install --no-deps -r requirements/lock.txt
COPY cli cli
COPY config config
COPY datagen datagen
COPY producers producers
COPY workers workers
COPY simulator simulator
COPY data/demo data/demo
RUN pip install --no-deps .

# The tokenizer the simulator setup (compose.sim.yaml) tokenizes with: built offline,
# byte-identical on every build (vocabulary 4096, eos id 2).
RUN python -c "from datagen.tokenization.tokenizer import build_tiny_tokenizer as b; \
b('/opt/datagen/tiny-tokenizer')"

# Not root. A named volume mounted on /data/output starts owned by this user; for a host
# folder (NFS) set DATAGEN_UID/DATAGEN_GID in compose to its owner instead.
RUN useradd --create-home --uid 1000 datagen \
    && mkdir -p /data/output \
    && chown datagen:datagen /data/output
USER datagen

CMD ["datagen", "--help"]
