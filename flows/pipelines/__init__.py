"""The Prefect flows, their tasks and settings, the local Prefect server and the deployments: the one package that imports Prefect."""
