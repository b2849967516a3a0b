// Package config is kvproxy's YAML schema: parsing with ${ENV} expansion,
// defaults, and validation whose messages name the offending field.
//
// It describes what to run; it builds nothing. Other packages turn the
// validated Config into their own settings.
package config
