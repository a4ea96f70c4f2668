"""The permissions of operator actions on stored configs (checked by ``common.permissions``), like jobs'."""

VIEW_CONFIGS = "configs.view_trainingconfig"
ADD_CONFIGS = "configs.add_trainingconfig"
# Reading the values of secret keys (training_configs.secrets) in stored configs and jobs' configs.
VIEW_SECRETS = "configs.view_config_secrets"
