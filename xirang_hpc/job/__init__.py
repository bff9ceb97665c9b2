"""The composition root: what runs inside a job, assembled from every layer below.

``training.run_training`` builds the trainer's hooks (checkpoint, monitor, serve's weight import,
comm, stop signals) and runs the loop; ``stages`` holds the pipeline's stage entry points. Only
``launch/`` imports this package.
"""
