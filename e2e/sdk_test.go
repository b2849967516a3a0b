package e2e

import (
	"errors"

	"github.com/openai/openai-go"
)

func asAPIError(err error, target **openai.Error) bool {
	return errors.As(err, target)
}
