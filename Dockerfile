# The worker image of the Beam stages on Dataflow (`--sdk_container_image`): Beam's own
# Python 3.11 SDK image, whose /opt/apache/beam/boot entrypoint starts the worker, plus
# this project installed from the launcher's pins (constraints.txt: `pip freeze` of the
# launcher's .venv), so that workers unpickle the code the launcher pickled, against the
# same library versions. Launch jobs with the same Beam (2.77.0) and Python (3.11).
#
#   docker build -t us-central1-docker.pkg.dev/my-gcp-project/padir/beam-worker:0.1.0 .
#   docker push us-central1-docker.pkg.dev/my-gcp-project/padir/beam-worker:0.1.0
FROM apache/beam_python3.11_sdk:2.77.0

WORKDIR /opt/padir
COPY pyproject.toml README.md constraints.txt ./
COPY components/ components/
COPY model/ model/
COPY pipelines/ pipelines/
COPY flows/ flows/
COPY theory/ theory/
# A regular (not editable) install: the packages live in site-packages, as on the launcher's
# import path. Fail the build, not a job, if the pins do not resolve or the stages do not import.
RUN pip install --no-cache-dir --constraint constraints.txt . \
    && python -c "import apache_beam, jax, tensorflow_text; \
assert apache_beam.__version__ == '2.77.0', apache_beam.__version__; \
import pipelines.prepare, pipelines.vocab, pipelines.encode, pipelines.distill, \
pipelines.decode, model.decoding.translator"
# Workers run as an unprivileged user: the code and site-packages stay root-owned and
# read-only to it. Beam's boot script only writes under /tmp (its semi-persistent directory)
# and HOME; nothing is installed at start-up, since the SDK and every dependency are in the
# image (--sdk_location=container, no requirements file).
RUN useradd --create-home --uid 10001 --user-group padir
USER padir
ENV HOME=/home/padir
# The entrypoint stays Beam's boot script (inherited from the base image).
