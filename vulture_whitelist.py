"""What vulture reports as unused but something uses by name: a framework, a template, the
wire, bench/ or the tests. Read by vulture alone ([tool.vulture] in pyproject.toml, which
also ignores the framework hooks it can match by decorator or name); no module imports it.

One group per reason. A name is added here only once it is known to be used; dead code is
removed instead.
"""


class _Used:
    def __getattr__(self, name: str) -> None:
        return None


_ = _Used()

# Named by dotted path in settings.py (MIDDLEWARE, REST_FRAMEWORK, SPECTACULAR_SETTINGS,
# AUTHENTICATION_BACKENDS, DEFAULT_EXCEPTION_REPORTER*): Django, DRF and drf-spectacular
# import them.
_.ApiResponses
_.Security
_.Sessions
_.Common
_.Csrf
_.Authentication
_.Messages
_.FrameOptions
_.ContentSecurityPolicy
_.ApiKeyAuthentication
_.SignedIn
_.exception_handler
_.OperationSchema
_.add_inference_paths
_.EmailOrUsernameBackend
_.RedactingReporterFilter
_.RedactingReporter

# Read by settings.py alone, which vulture does not scan (exclude, pyproject.toml).
_.REDIS_SCHEMES
_.celery_redis_url
_.ROUTES

# AppConfig subclasses: Django finds each in its app's apps.py.
_.AdaptersConfig
_.AtriumConfig
_.BatchesConfig
_.BillingConfig
_.InferenceConfig
_.RequestLogsConfig
_.TenantsConfig
_.WebuiConfig

# Model fields: the ORM reads them by name (queries, update_fields, serializers' field
# lists, templates); the services assign some of them before a save.
_.accepted_by
_.actor_key_prefix
_.actor_user
_.claimed_until
_.delivered_at
_.error_file
_.finished_at
_.last_error
_.last_status_code
_.next_attempt_at
_.output_file
_.price_ref
_.recorded_at
_.replaced_by
_.requested_by
_.runner_lease_until
_.surcharge_ref
_.target_modules
_.updated_at
_.response_retention_days

# TextChoices members: read through the enum (Window.choices, Window.values) and stored.
_.INPUT
_.CACHED_INPUT
_.OUTPUT
_.DAY
_.MONTH
_.VIEWER

# DRF serializer fields: DRF reads the declared fields off the class.
_.adapter_config
_.adapter_model
_.bucket_width
_.download_url
_.end_time
_.input_cached_tokens
_.next_page
_.num_model_requests
_.owner_email
_.plan_limits
_.start_time

# SerializerMethodField getters: DRF calls get_<field> for each.
_.get_chunk_bytes
_.get_created_by
_.get_download_url
_.get_model
_.get_name
_.get_object
_.get_request_id
_.get_status

# drf-spectacular's authentication extension: found by subclassing, called by name.
_.ApiKeyScheme
_.target_class
_.get_security_definition

# Django forms: fields read through cleaned_data, a Field subclass's options.
_.expires_on
_.grace_hours
_.widget
_.default_validators

# Fields of the console's dataclasses that only the templates read (webui/templates).
_.about
_.plot_left
_.x_labels
_.ttft_p95_s
_.itl_p95_s
_.ttft_p99_s  # the health page's tiers (webui/health.py TierHealth)
_.cache_hit_rate  # the usage page's prompt cache (webui/selectors.py UsageReport)
_.queue_p99_s
_.objective
_.input_price
_.output_price
_.billed_per_million
_.cost_per_million
_.latency_window
_.slo_window
_.active_keys
_.plan_name
_.requests_stolen
_.kv_usage
_.kv_blocks_used
_.kv_blocks_total
_.prefix_cache_hit_rate
_.tokens_generated
_.adapters_in_slots
_.age_s

# Written to the wire through asdict (engine/outputs.py Usage.to_dict, docs/protocol.md).
_.ttft_s
_.adapter_wait_s

# Request-body fields clients send back from an earlier answer: accepted and ignored (the
# models forbid any field they do not declare).
_.parsed_arguments
_.function_call
_.annotations
_.audio
_.strict

# vLLM's /tokenize fields a chat request cannot render otherwise: declared so that only
# their default passes, and another is a 400 naming them (inference/tokenizing.py).
_.add_generation_prompt
_.continue_final_message

# Responses API fields Atrium does not serve: declared so that only their no-op values
# pass, and any other is a 400 naming them (inference/protocols/responses_request.py).
_.include_obfuscation
_.effort
_.generate_summary
_.reasoning
_.service_tier
_.max_tool_calls
_.prompt_cache_key
_.prompt_cache_retention
_.context_management

# Messages API fields Atrium accepts as hints or refuses past their no-op values, never
# reads (inference/protocols/messages.py).
_.citations
_.cache_control
_.caller
_.toolset_name
_.eager_input_streaming
_.defer_loading
_.allowed_callers
_.input_examples
_.thinking
_.mcp_servers
_.container
_.speed
_.inference_geo
_.diagnostics
_.user_profile_id
_.workspace_id

# Hooks and attributes a library reads: Django's ASGI handler and request, http.server's
# handler, prometheus-client's collector, tokenizers' Tokenizer.
_.read_body
_.upload_handlers
_.do_GET
_.log_message
_.describe
_.pre_tokenizer
_.post_processor

# Parameters a caller passes by keyword (Channels' receive) or by position to a signature
# that must match the protocol's (admin permissions, drf-spectacular, __aexit__, a signal
# handler).
_.bytes_data
_.obj
_.auto_schema
_.tb
_.signum
_.frame

# Called by bench/ scripts, which vulture does not scan (and by the tests).
_.tenant_detector
_.request_log_record
_.misses
_.last_compile_seconds

# Used by the tests alone: not an API a user or an operator calls. Kept for now, listed
# so each is either used by the product or removed with its tests.
_.compiles
_.console_methods
_.generate_reference
_.is_public_address
_.open_count
_.plot_bottom
_.quotes_forget
_.render_prometheus
_.slots_held
_.spend_get
_.wait_written
_.holds  # engine/host_kv.py: what the host tier holds, by hash and by tenant
_.used_by
