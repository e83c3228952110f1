#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image; the zip's files are in
# /autograder/source. The image is Gradescope's Ubuntu 22.04 base (gradescope/autograder-base:latest),
# whose python3 is 3.10. The course needs Python 3.11.5 or a later 3.11
# (requirements.lock is resolved for it), so it comes from the deadsnakes PPA, which carries the
# newest 3.11 release for 22.04; `make setup` stops with a clear message if that were ever older.
set -euo pipefail
cd /autograder/source
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends software-properties-common gpg-agent make
add-apt-repository -y ppa:deadsnakes/ppa
apt-get update
apt-get install -y --no-install-recommends python3.11 python3.11-venv
# The course's own setup: a .venv with the lock, the model package and toyllm (see the Makefile).
make setup PY=python3.11
