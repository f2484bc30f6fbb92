"""The harness's side of the seam to FLA: what touches FLA only to run checks, never to make a model safe.
:mod:`~.interpreter` runs FLA's kernels on a CPU, :mod:`~.serving` serves pure-torch stand-ins for them,
:mod:`~.models` lists FLA's model zoo, :mod:`~.hopper_guard` recognises FLA's #640 refusal, :mod:`~.cp_field`
builds FLA's CP context per layer. Importing them imports nothing from FLA."""
