"""The permissions of operator actions on stored configs (checked by ``common.permissions``), like jobs'."""

VIEW_CONFIGS = "configs.view_trainingconfig"
ADD_CONFIGS = "configs.add_trainingconfig"
